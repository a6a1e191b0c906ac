//! The read model: the one form in which controllers see what the informers store.
//!
//! - [`Stored<K>`] (PVs and claims, [`StoredVolume`], [`StoredClaim`]): metadata at hand, named
//!   readers that decode only the fields they return, and [`Stored::decode`] for the whole API
//!   object. Nothing else reaches the object's kept JSON.
//! - [`StoredPod`]: the fields of a pod the controllers read, decoded straight from the wire,
//!   read-only (no `Serialize`: nothing can write a pod back from it).
//! - [`VolumeAttachment`]: the VolumeAttachment, lossless (what attach/detach creates too), with its
//!   rare inline PV spec boxed.
//!
//! How they are held (`packed`, `slim`, `attachment`, and `lean` for decoding without managed
//! fields) is private to `store`: a controller names these types and plain k8s-openapi ones
//! only, and every decode that costs is a call named `decode` or a reader documented to decode
//! (never a field access in a loop).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{self as v1, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};

use crate::store::packed::{Packable, Packed};
use crate::store::slim;

pub use crate::api::volumeattachment::{
    VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec, VolumeAttachmentStatus,
};
pub use crate::store::packed::Packable as Storable;
pub use crate::store::slim::{PodRead, Present, Volume as PodVolume};

/// A PV or claim as the stores keep it: metadata decoded, the rest packed until read.
#[derive(Clone, Debug)]
pub struct Stored<K>(Packed<K>);

/// A PersistentVolume as stored.
pub type StoredVolume = Stored<PersistentVolume>;
/// A PersistentVolumeClaim as stored.
pub type StoredClaim = Stored<PersistentVolumeClaim>;

impl<K: Packable> Stored<K> {
    /// Stores `obj` (without its managed fields, which no controller reads).
    pub fn new(obj: K) -> Self {
        Self(Packed::new(obj))
    }

    pub fn meta(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    /// The whole API object (less managed fields), built from the kept JSON: a full decode and
    /// a copy of the metadata on every call. For writers and whole-object decisions; a reader of
    /// a few fields has its own method.
    pub fn decode(&self) -> K {
        self.0.unpack()
    }

    /// Decodes the fields `V` names (serde steps over the rest). An error cannot happen short of
    /// a bug (the JSON decoded as a `K` when stored), so it is logged here, once for every reader.
    fn read<V: DeserializeOwned>(&self) -> Result<V, serde_json::Error> {
        self.0.view::<V>().inspect_err(|e| {
            tracing::error!(kind = K::KIND, name = ?self.meta().name, error = %e, "stored object does not read back");
        })
    }
}

/// Decodes the full object, then packs it: the watch and list responses carry `K`'s JSON.
impl<'de, K: Packable> Deserialize<'de> for Stored<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        K::deserialize(d).map(Self::new)
    }
}

impl<K: Packable> k8s_openapi::Resource for Stored<K> {
    const API_VERSION: &'static str = K::API_VERSION;
    const GROUP: &'static str = K::GROUP;
    const KIND: &'static str = K::KIND;
    const VERSION: &'static str = K::VERSION;
    const URL_PATH_SEGMENT: &'static str = K::URL_PATH_SEGMENT;
    type Scope = K::Scope;
}

impl<K: Packable> k8s_openapi::Metadata for Stored<K> {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.0.metadata
    }
}

/// Whatever a cache can keep as a shared stored object: one already stored (shared with the
/// informer's store, not copied) or a full object (stored here).
pub trait IntoStored<K> {
    fn into_stored(self) -> Arc<Stored<K>>;
}

impl<K> IntoStored<K> for Arc<Stored<K>> {
    fn into_stored(self) -> Arc<Stored<K>> {
        self
    }
}

impl<K: Packable> IntoStored<K> for Arc<K> {
    fn into_stored(self) -> Arc<Stored<K>> {
        Arc::new(Stored::new(Arc::unwrap_or_clone(self)))
    }
}

impl<K: Packable> IntoStored<K> for K {
    fn into_stored(self) -> Arc<Stored<K>> {
        Arc::new(Stored::new(self))
    }
}

/// What attach/detach reads of a PV: access modes, the claim it is bound to, and its CSI or
/// in-tree source. Field names and types are the API's, so a stored volume always reads back.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSource {
    #[serde(default)]
    pub access_modes: Vec<String>,
    pub claim_ref: Option<BoundClaim>,
    pub csi: Option<CsiSource>,
    // In-tree sources (translated to CSI, or iSCSI/FC attached in-tree); boxed, as they are rare.
    pub aws_elastic_block_store: Option<Box<v1::AWSElasticBlockStoreVolumeSource>>,
    pub gce_persistent_disk: Option<Box<v1::GCEPersistentDiskVolumeSource>>,
    pub azure_disk: Option<Box<v1::AzureDiskVolumeSource>>,
    pub azure_file: Option<Box<v1::AzureFilePersistentVolumeSource>>,
    pub cinder: Option<Box<v1::CinderPersistentVolumeSource>>,
    pub vsphere_volume: Option<Box<v1::VsphereVirtualDiskVolumeSource>>,
    pub portworx_volume: Option<Box<v1::PortworxVolumeSource>>,
    pub iscsi: Option<Box<v1::ISCSIPersistentVolumeSource>>,
    pub fc: Option<Box<v1::FCVolumeSource>>,
    /// The PV's labels and annotations, copied from metadata only for the sources whose CSI
    /// translation reads them (GCE PD's zones, Azure File's resource group).
    #[serde(skip)]
    pub labels: BTreeMap<String, String>,
    #[serde(skip)]
    pub annotations: BTreeMap<String, String>,
}

/// The claim a volume is bound to (`spec.claimRef`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct BoundClaim {
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub uid: Option<String>,
}

/// A PV's CSI source, as far as attaching reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CsiSource {
    pub driver: String,
    pub volume_handle: String,
}

/// `status.phase` alone, as a wire struct: the reader below decodes nothing else.
#[derive(Default, Deserialize)]
struct PhaseOnly {
    phase: Option<String>,
}

impl StoredVolume {
    /// `status.phase`, decoding that field only. `None` when unset, or (logged) if it does not
    /// read back, which cannot happen short of a bug.
    pub fn phase(&self) -> Option<String> {
        #[derive(Deserialize)]
        struct Wire {
            status: Option<PhaseOnly>,
        }
        self.read::<Wire>().ok()?.status?.phase
    }

    /// Decodes the spec fields of [`VolumeSource`] only (serde steps over the rest). `None` if
    /// they do not read back, which cannot happen short of a bug (the JSON decoded as a PV when
    /// stored); it is logged, and callers leave the volume as it is.
    pub fn source(&self) -> Option<VolumeSource> {
        #[derive(Deserialize)]
        struct Wire {
            #[serde(default)]
            spec: Option<VolumeSource>,
        }
        let mut spec = self.read::<Wire>().ok()?.spec.unwrap_or_default();
        let meta = self.meta();
        if spec.gce_persistent_disk.is_some() {
            spec.labels = meta.labels.clone().unwrap_or_default();
        }
        if spec.azure_file.is_some() {
            spec.annotations = meta.annotations.clone().unwrap_or_default();
        }
        Some(spec)
    }
}

/// What resolving a pod's claim, or finding a class's claims, reads besides the metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClaimBinding {
    /// `spec.volumeName`, empty when unset.
    pub volume_name: String,
    /// The claim's class as `pv::claim_class` reads it on a decoded claim: the beta annotation
    /// `volume.beta.kubernetes.io/storage-class` if set, else `spec.storageClassName`.
    pub class: Option<String>,
    /// `status.phase`.
    pub phase: Option<String>,
}

impl StoredClaim {
    /// Decodes `spec.volumeName`, `spec.storageClassName` and `status.phase` only. An error
    /// cannot happen short of a bug (the JSON decoded as a claim when stored); it is logged and
    /// returned.
    pub fn binding(&self) -> Result<ClaimBinding, serde_json::Error> {
        #[derive(Default, Deserialize)]
        struct Wire {
            spec: Option<Spec>,
            status: Option<PhaseOnly>,
        }
        #[derive(Default, Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Spec {
            volume_name: Option<String>,
            storage_class_name: Option<String>,
        }
        let w = self.read::<Wire>()?;
        let spec = w.spec.unwrap_or_default();
        let annotated = self
            .meta()
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::vocab::annotations::ANN_BETA_CLASS))
            .cloned();
        Ok(ClaimBinding {
            volume_name: spec.volume_name.unwrap_or_default(),
            class: annotated.or(spec.storage_class_name),
            phase: w.status.and_then(|s| s.phase),
        })
    }
}

/// A pod as the stores keep it: what the controllers read and nothing else (annotations,
/// volumes that name no claim and are not attachable inline, and the statuses of containers no
/// longer running are dropped when stored).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct StoredPod(slim::Pod);

impl StoredPod {
    /// The same decoding the watch does, from a full pod (tests, and callers holding one). An
    /// error, not a default: an empty pod would name no claim and look finished.
    pub fn from_pod(pod: &v1::Pod) -> Result<Self, serde_json::Error> {
        let mut p = slim::Pod::try_from(pod)?;
        p.trim();
        Ok(Self(p))
    }

    pub fn meta(&self) -> &ObjectMeta {
        &self.0.metadata
    }

    /// `spec.nodeName`, when set and not empty.
    pub fn node_name(&self) -> Option<&str> {
        self.0
            .spec
            .as_ref()?
            .node_name
            .as_deref()
            .filter(|n| !n.is_empty())
    }

    pub fn phase(&self) -> Option<&str> {
        self.0.status.as_ref()?.phase.as_deref()
    }

    /// The volumes that name a claim or are attachable inline, in the pod's order.
    pub fn volumes(&self) -> &[PodVolume] {
        self.0
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_deref())
            .unwrap_or_default()
    }

    /// The informers' trim, applied before a pod is stored.
    pub(crate) fn trim(&mut self) {
        self.0.trim()
    }
}

impl PodRead for StoredPod {
    fn meta(&self) -> &ObjectMeta {
        self.0.meta()
    }

    fn phase(&self) -> Option<&str> {
        self.0.phase()
    }

    fn claim_volumes(&self) -> Vec<(&str, Option<(&str, bool)>)> {
        self.0.claim_volumes()
    }

    fn any_running(&self) -> bool {
        self.0.any_running()
    }
}

crate::api::addressed_as!(StoredPod, v1::Pod, 0.metadata);

#[cfg(test)]
mod tests {
    use super::*;

    fn pv() -> PersistentVolume {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": "pv-1", "labels": {"topology.kubernetes.io/zone": "z1"},
                         "annotations": {"a": "b"}},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "capacity": {"storage": "1Gi"},
                "claimRef": {"namespace": "app", "name": "data", "uid": "9"},
                "csi": {"driver": "loop.stowage.dev", "volumeHandle": "pv-1"},
                "mountOptions": ["noatime"]
            },
            "status": {"phase": "Bound"}
        }))
        .unwrap()
    }

    /// The reader returns what the API object holds, and copies metadata only for the sources
    /// that read it.
    #[test]
    fn a_volumes_source_is_the_api_objects() {
        let full = pv();
        let stored = StoredVolume::new(full.clone());
        let got = stored.source().unwrap();
        let spec = full.spec.clone().unwrap();
        assert_eq!(got.access_modes, spec.access_modes.unwrap());
        let r = spec.claim_ref.unwrap();
        assert_eq!(
            got.claim_ref,
            Some(BoundClaim {
                namespace: r.namespace,
                name: r.name,
                uid: r.uid
            })
        );
        let csi = spec.csi.unwrap();
        assert_eq!(
            got.csi,
            Some(CsiSource {
                driver: csi.driver,
                volume_handle: csi.volume_handle
            })
        );
        assert!(got.labels.is_empty() && got.annotations.is_empty());
        assert_eq!(stored.decode(), full);
        assert_eq!(stored.meta().name.as_deref(), Some("pv-1"));
        assert_eq!(stored.phase().as_deref(), Some("Bound"));
        assert_eq!(StoredVolume::new(PersistentVolume::default()).phase(), None);
        // A volume with no spec reads as no source.
        assert_eq!(
            StoredVolume::new(PersistentVolume::default()).source(),
            Some(VolumeSource::default())
        );
    }

    #[test]
    fn a_claims_binding_is_the_api_objects() {
        let c: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data", "namespace": "app"},
            "spec": {"volumeName": "pv-1", "storageClassName": "fast", "resources": {"requests": {"storage": "1Gi"}}},
            "status": {"phase": "Bound"}
        }))
        .unwrap();
        let stored = StoredClaim::new(c.clone());
        assert_eq!(
            stored.binding().unwrap(),
            ClaimBinding {
                volume_name: "pv-1".into(),
                class: Some("fast".into()),
                phase: Some("Bound".into())
            }
        );
        // The beta annotation wins over the field, as on the decoded claim.
        let mut beta = c.clone();
        beta.metadata.annotations = Some(
            [(
                crate::vocab::annotations::ANN_BETA_CLASS.to_string(),
                "old".to_string(),
            )]
            .into(),
        );
        let binding = StoredClaim::new(beta.clone()).binding().unwrap();
        assert_eq!(binding.class.as_deref(), Some("old"));
        assert_eq!(binding.class.as_deref(), crate::store::pv::claim_class(&beta));
        assert_eq!(stored.decode(), c);
        assert_eq!(
            StoredClaim::new(PersistentVolumeClaim::default())
                .binding()
                .unwrap(),
            ClaimBinding::default()
        );
    }

    #[test]
    fn a_stored_pod_reads_like_the_api_pod() {
        let p: v1::Pod = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": {"a": "b"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "app"}],
                     "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}},
                                 {"name": "cfg", "configMap": {"name": "m"}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        let stored = StoredPod::from_pod(&p).unwrap();
        assert_eq!(stored.node_name(), Some("n1"));
        assert_eq!(stored.phase(), Some("Running"));
        assert_eq!(stored.volumes().len(), 1, "the configMap volume is not kept");
        assert_eq!(stored.volumes()[0].name, "data");
        assert_eq!(stored.meta().annotations, None, "annotations are not kept");
        assert_eq!(
            crate::store::pods::pod_claims(&stored),
            crate::store::pods::pod_claims(&p)
        );
        let mut unscheduled = p.clone();
        unscheduled.spec.as_mut().unwrap().node_name = Some(String::new());
        assert_eq!(StoredPod::from_pod(&unscheduled).unwrap().node_name(), None);
    }
}

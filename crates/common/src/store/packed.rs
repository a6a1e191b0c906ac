//! Volumes and claims as the controllers store them: metadata decoded, everything else kept as
//! the object's own compact JSON and decoded when a controller reads it.
//!
//! The binder holds every PV and claim of the cluster for as long as it runs, and k8s-openapi's
//! layout is what that costs: a `PersistentVolume` is ~3.5 KB before any field is set (every
//! volume source is an inline `Option`) and each non-empty map is a B-tree node sized for eleven
//! entries. Packed, a volume is its metadata plus a few hundred bytes of JSON.
//!
//! Nothing is dropped: the JSON is the full object as decoded (less `managedFields`, which no
//! controller reads), so unpacking gives back exactly what a stored API object held, and a PV or
//! claim written back from it loses no field. Controllers see it as `model::Stored`.
//!
//! The metadata stays decoded so that names, versions, annotations, finalizers and deletion
//! state (read on every event, and by kube's store) cost no decoding.

use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// An API object whose metadata is decoded and whose other fields are kept as JSON.
pub struct Packed<K> {
    /// Complete (less `managedFields`): readers may use it as the object's own.
    pub metadata: ObjectMeta,
    rest: Rest<K>,
}

enum Rest<K> {
    /// `K` with empty metadata, as serde_json writes it; it decoded back when packed.
    Json(Box<[u8]>),
    /// Kept whole because its JSON did not decode back (never seen; see `Packed::new`).
    Whole(Box<K>),
}

/// What can be packed: an API type with standard metadata that JSON round-trips.
pub trait Packable:
    k8s_openapi::Resource + k8s_openapi::Metadata<Ty = ObjectMeta> + Serialize + DeserializeOwned + Clone
{
}

impl<K> Packable for K where
    K: k8s_openapi::Resource + k8s_openapi::Metadata<Ty = ObjectMeta> + Serialize + DeserializeOwned + Clone
{
}

impl<K: Packable> Packed<K> {
    /// Packs `obj`, dropping its managed fields. The JSON is decoded once here, so that reading
    /// it later cannot fail: the same bytes through the same decoder. An object whose JSON does
    /// not read back is kept whole instead (logged; it only costs memory).
    pub fn new(mut obj: K) -> Self {
        let mut metadata = std::mem::take(obj.metadata_mut());
        metadata.managed_fields = None;
        let rest = match serde_json::to_vec(&obj).map(|json| {
            let back = serde_json::from_slice::<K>(&json);
            (json, back)
        }) {
            Ok((json, Ok(_))) => Rest::Json(json.into_boxed_slice()),
            Ok((_, Err(e))) | Err(e) => {
                tracing::warn!(kind = K::KIND, name = ?metadata.name, error = %e, "kept unpacked: its JSON does not read back");
                Rest::Whole(Box::new(obj))
            }
        };
        Self { metadata, rest }
    }

    /// The full object (less managed fields).
    pub fn unpack(&self) -> K {
        let mut obj = match &self.rest {
            Rest::Json(json) => {
                serde_json::from_slice(json).expect("these bytes decoded when they were packed")
            }
            Rest::Whole(obj) => K::clone(obj),
        };
        *obj.metadata_mut() = self.metadata.clone();
        obj
    }

    /// Decodes only what `V` declares from the kept JSON; serde steps over every other field
    /// without building it. For a reader of a few fields on a hot path: `unpack` builds the whole
    /// object (a PV is ~3.5 KB of struct) and clones the metadata. `V` must declare its fields
    /// with `K`'s names and types (the metadata is not in the JSON; read the field).
    pub fn view<V: DeserializeOwned>(&self) -> Result<V, serde_json::Error> {
        match &self.rest {
            Rest::Json(json) => serde_json::from_slice(json),
            Rest::Whole(obj) => serde_json::to_value(obj).and_then(V::deserialize),
        }
    }

    /// Bytes of JSON held beside the decoded metadata (0 when kept whole).
    #[cfg(test)]
    fn packed_len(&self) -> usize {
        match &self.rest {
            Rest::Json(json) => json.len(),
            Rest::Whole(_) => 0,
        }
    }
}

impl<K: Clone> Clone for Packed<K> {
    fn clone(&self) -> Self {
        Self {
            metadata: self.metadata.clone(),
            rest: match &self.rest {
                Rest::Json(json) => Rest::Json(json.clone()),
                Rest::Whole(obj) => Rest::Whole(obj.clone()),
            },
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for Packed<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Packed");
        d.field("metadata", &self.metadata);
        match &self.rest {
            Rest::Json(json) => d.field("rest", &String::from_utf8_lossy(json)),
            Rest::Whole(obj) => d.field("whole", obj),
        };
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use serde::Deserialize;

    fn pv_json() -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": "pv-1",
                "uid": "0b7c6f5e-1111-2222-3333-444455556666",
                "resourceVersion": "4242",
                "creationTimestamp": "2026-11-26T04:00:00Z",
                "annotations": {"pv.kubernetes.io/bound-by-controller": "yes"},
                "labels": {"tier": "gold"},
                "finalizers": ["kubernetes.io/pv-protection"],
                "managedFields": [{"manager": "kubectl", "operation": "Apply", "fieldsV1": {"f:spec": {}}}]
            },
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": "fast",
                "volumeMode": "Filesystem",
                "claimRef": {"kind": "PersistentVolumeClaim", "namespace": "app", "name": "data",
                             "uid": "9", "apiVersion": "v1", "resourceVersion": "77"},
                "csi": {"driver": "loop.stowage.dev", "volumeHandle": "pv-1",
                        "volumeAttributes": {"size": "1Gi"}},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1"]}]}]}},
                "mountOptions": ["noatime"]
            },
            "status": {"phase": "Bound", "lastPhaseTransitionTime": "2026-11-26T04:00:01Z"}
        })
    }

    #[test]
    fn a_packed_volume_unpacks_to_the_object_it_was_less_managed_fields() {
        let full: PersistentVolume = serde_json::from_value(pv_json()).unwrap();
        let packed = Packed::new(serde_json::from_value::<PersistentVolume>(pv_json()).unwrap());
        let mut want = full.clone();
        want.metadata.managed_fields = None;
        assert_eq!(packed.unpack(), want);
        assert!(packed.metadata.managed_fields.is_none());
        // The metadata is readable without unpacking.
        assert_eq!(
            packed.metadata.finalizers.as_deref(),
            Some(&["kubernetes.io/pv-protection".to_string()][..])
        );
        // Packing what was unpacked changes nothing (the binder stores what it wrote this way).
        assert_eq!(Packed::new(packed.unpack()).unpack(), want);
        // And the JSON a PUT would send carries every field the API object had.
        let mut sent = serde_json::to_value(packed.unpack()).unwrap();
        let mut wire = pv_json();
        wire["metadata"].as_object_mut().unwrap().remove("managedFields");
        sent.as_object_mut().unwrap().remove("metadata");
        wire.as_object_mut().unwrap().remove("metadata");
        assert_eq!(sent, wire);
    }

    #[test]
    fn a_packed_claim_round_trips_and_is_small() {
        let claim = serde_json::json!({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data", "namespace": "app", "uid": "9", "resourceVersion": "78",
                         "annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                     "storageClassName": "fast", "volumeName": "pv-1", "volumeMode": "Filesystem"},
            "status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}}
        });
        let full: PersistentVolumeClaim = serde_json::from_value(claim.clone()).unwrap();
        let packed = Packed::new(serde_json::from_value::<PersistentVolumeClaim>(claim).unwrap());
        assert_eq!(packed.unpack(), full);
        // What a stored volume or claim costs besides its metadata: the struct and its JSON,
        // against the API type's struct alone (its maps and strings come on top).
        let pv = Packed::new(serde_json::from_value::<PersistentVolume>(pv_json()).unwrap());
        let packed_pv = std::mem::size_of::<Packed<PersistentVolume>>() + pv.packed_len();
        assert!(
            packed_pv * 3 < std::mem::size_of::<PersistentVolume>(),
            "{packed_pv}"
        );
        let packed_claim = std::mem::size_of::<Packed<PersistentVolumeClaim>>() + packed.packed_len();
        assert!(
            packed_claim < std::mem::size_of::<PersistentVolumeClaim>(),
            "{packed_claim}"
        );
    }

    #[test]
    fn a_view_reads_the_fields_it_names_and_nothing_else() {
        #[derive(Debug, PartialEq, Deserialize)]
        struct Csi {
            driver: String,
            #[serde(rename = "volumeHandle")]
            volume_handle: String,
        }
        #[derive(Debug, PartialEq, Deserialize)]
        struct Spec {
            csi: Option<Csi>,
            #[serde(rename = "mountOptions")]
            mount_options: Option<Vec<String>>,
        }
        #[derive(Debug, PartialEq, Deserialize)]
        struct View {
            spec: Spec,
            status: Option<serde_json::Value>,
        }
        let packed = Packed::new(serde_json::from_value::<PersistentVolume>(pv_json()).unwrap());
        let want = View {
            spec: Spec {
                csi: Some(Csi {
                    driver: "loop.stowage.dev".into(),
                    volume_handle: "pv-1".into(),
                }),
                mount_options: Some(vec!["noatime".into()]),
            },
            status: Some(pv_json()["status"].clone()),
        };
        assert_eq!(packed.view::<View>().unwrap(), want);
        // An object kept whole answers the same.
        let whole = Packed::<PersistentVolume> {
            metadata: ObjectMeta::default(),
            rest: Rest::Whole(Box::new(packed.unpack())),
        };
        assert_eq!(whole.view::<View>().unwrap(), want);
        // A view that asks for a field under another type fails instead of guessing.
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Wrong {
            spec: std::collections::BTreeMap<String, String>,
        }
        assert!(packed.view::<Wrong>().is_err());
    }

    #[test]
    fn an_empty_object_packs_too() {
        let pv: Packed<PersistentVolume> = Packed::new(PersistentVolume::default());
        assert!(pv.packed_len() > 0);
        assert_eq!(pv.unpack(), PersistentVolume::default());
    }
}

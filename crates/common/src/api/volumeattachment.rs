//! The VolumeAttachment as the controllers hold it (`VolumeAttachment`, named as the API names
//! it): every field of the API type, with the inline PV spec boxed.
//!
//! k8s-openapi's `VolumeAttachment` holds `spec.source.inlineVolumeSpec` by value: a whole
//! `PersistentVolumeSpec`, whose every volume source is an inline `Option`. That field is most
//! of the type's ~3.6 KB, and it is set only for in-tree inline volumes migrated to CSI, which
//! stowage never creates. An attachment is moved by value many times between the wire and the
//! store (decoding, the watcher's event types, the informer, a create's result on its way back
//! to the controller): boxing it cut the bytes the controller copies per attach to about a third
//! and lowered its peak RSS (docs/benchmarks-history.md, "Attachments by pointer").
//!
//! This type is lossless: it decodes and encodes the same JSON as the API
//! type (the round trip is tested), so it is also what attach/detach creates.

use k8s_openapi::api::core::v1::PersistentVolumeSpec;
use k8s_openapi::api::storage::v1 as api;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize, Serializer};

pub use k8s_openapi::api::storage::v1::VolumeAttachmentStatus;

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct VolumeAttachment {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: VolumeAttachmentSpec,
    pub status: Option<VolumeAttachmentStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeAttachmentSpec {
    pub attacher: String,
    pub node_name: String,
    pub source: VolumeAttachmentSource,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeAttachmentSource {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistent_volume_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inline_volume_spec: Option<Box<PersistentVolumeSpec>>,
}

/// The API type's encoding: `apiVersion` and `kind` first, no `status` when there is none.
impl Serialize for VolumeAttachment {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Wire<'a> {
            api_version: &'static str,
            kind: &'static str,
            metadata: &'a ObjectMeta,
            spec: &'a VolumeAttachmentSpec,
            #[serde(skip_serializing_if = "Option::is_none")]
            status: &'a Option<VolumeAttachmentStatus>,
        }
        Wire {
            api_version: <Self as k8s_openapi::Resource>::API_VERSION,
            kind: <Self as k8s_openapi::Resource>::KIND,
            metadata: &self.metadata,
            spec: &self.spec,
            status: &self.status,
        }
        .serialize(s)
    }
}

crate::api::addressed_as!(VolumeAttachment, api::VolumeAttachment, metadata);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::lean::Lean;
    use serde_json::json;

    // Conversions to compare with the API type: nothing outside these tests converts.
    impl From<api::VolumeAttachment> for VolumeAttachment {
        fn from(va: api::VolumeAttachment) -> Self {
            Self {
                metadata: va.metadata,
                spec: VolumeAttachmentSpec {
                    attacher: va.spec.attacher,
                    node_name: va.spec.node_name,
                    source: VolumeAttachmentSource {
                        persistent_volume_name: va.spec.source.persistent_volume_name,
                        inline_volume_spec: va.spec.source.inline_volume_spec.map(Box::new),
                    },
                },
                status: va.status,
            }
        }
    }

    impl From<VolumeAttachment> for api::VolumeAttachment {
        fn from(va: VolumeAttachment) -> Self {
            Self {
                metadata: va.metadata,
                spec: api::VolumeAttachmentSpec {
                    attacher: va.spec.attacher,
                    node_name: va.spec.node_name,
                    source: api::VolumeAttachmentSource {
                        persistent_volume_name: va.spec.source.persistent_volume_name,
                        inline_volume_spec: va.spec.source.inline_volume_spec.map(|b| *b),
                    },
                },
                status: va.status,
            }
        }
    }

    fn full() -> serde_json::Value {
        json!({
            "apiVersion": "storage.k8s.io/v1",
            "kind": "VolumeAttachment",
            "metadata": {
                "name": "csi-0123",
                "uid": "9f1c",
                "resourceVersion": "42",
                "finalizers": ["external-attacher/loop-stowage-dev"],
                "annotations": {"a": "b"}
            },
            "spec": {
                "attacher": "loop.stowage.dev",
                "nodeName": "n1",
                "source": {
                    "persistentVolumeName": "pv-1",
                    "inlineVolumeSpec": {
                        "capacity": {"storage": "1Gi"},
                        "csi": {"driver": "loop.stowage.dev", "volumeHandle": "h"},
                        "accessModes": ["ReadWriteOnce"]
                    }
                }
            },
            "status": {
                "attached": true,
                "attachmentMetadata": {"devicePath": "/dev/loop3"},
                "detachError": {"message": "busy", "time": "2026-11-26T10:00:00Z", "errorCode": 5}
            }
        })
    }

    /// Every field survives: decoded and encoded again, the JSON is the API type's.
    #[test]
    fn it_reads_and_writes_what_the_api_type_does() {
        let api: api::VolumeAttachment = serde_json::from_value(full()).unwrap();
        let ours: VolumeAttachment = serde_json::from_value(full()).unwrap();
        assert_eq!(VolumeAttachment::from(api.clone()), ours);
        assert_eq!(api::VolumeAttachment::from(ours.clone()), api);
        assert_eq!(
            serde_json::to_value(&ours).unwrap(),
            serde_json::to_value(&api).unwrap()
        );
        // A fresh one, as attach/detach creates it: no status, no inline spec.
        let mut bare = ours;
        bare.status = None;
        bare.spec.source.inline_volume_spec = None;
        let text = serde_json::to_value(&bare).unwrap();
        assert!(text.get("status").is_none());
        assert!(text["spec"]["source"].get("inlineVolumeSpec").is_none());
        assert_eq!(text["apiVersion"], "storage.k8s.io/v1");
        assert_eq!(text["kind"], "VolumeAttachment");
    }

    /// The point of the type: a move copies a fraction of the API type's bytes.
    #[test]
    fn it_is_a_fraction_of_the_api_types_size() {
        let ours = std::mem::size_of::<VolumeAttachment>();
        let theirs = std::mem::size_of::<api::VolumeAttachment>();
        assert!(ours * 3 < theirs, "{ours} bytes against the API type's {theirs}");
    }

    /// Decoded through `Lean` (as the watch does), managed fields are skipped like for any type.
    #[test]
    fn it_decodes_lean() {
        let mut v = full();
        v["metadata"]["managedFields"] = json!([{"manager": "x", "fieldsV1": {"f:spec": {}}}]);
        let lean: Lean<VolumeAttachment> = serde_json::from_value(v).unwrap();
        assert!(lean.0.metadata.managed_fields.is_none());
        assert_eq!(lean.0.spec.source.persistent_volume_name.as_deref(), Some("pv-1"));
    }
}

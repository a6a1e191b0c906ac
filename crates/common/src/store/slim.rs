//! The pod as the controllers store it: only what they read, decoded straight from the wire.
//!
//! Pods are the most numerous big objects a controller watches, and a k8s-openapi `Pod` costs
//! ~2.4 KB before any field is set, plus ~3.2 KB per `Volume` (every volume source is an inline
//! `Option`). Trimming a full `Pod` after decoding keeps those sizes; this type never has them:
//! serde skips the fields it does not name, so the watch neither allocates nor keeps them. The
//! field names mirror the API type's, so readers look the same on both.
//!
//! Read-only by design: it has no `Serialize`, so nothing can write a pod back from it (that
//! would drop every field it does not know).

use k8s_openapi::api::core::v1::{
    AWSElasticBlockStoreVolumeSource, AzureDiskVolumeSource, AzureFileVolumeSource, CinderVolumeSource,
    FCVolumeSource, GCEPersistentDiskVolumeSource, ISCSIVolumeSource, PersistentVolumeClaimVolumeSource,
    PortworxVolumeSource, VsphereVirtualDiskVolumeSource,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<PodSpec>,
    pub status: Option<PodStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    pub node_name: Option<String>,
    pub volumes: Option<Vec<Volume>>,
}

/// A pod volume: only the kinds that name a claim or that attach/detach attaches inline are
/// kept (see [`Pod::trim`]). The inline sources are boxed: rare, and a pointer each when absent.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    pub persistent_volume_claim: Option<PersistentVolumeClaimVolumeSource>,
    /// A generic ephemeral volume; its claim template is never read here.
    pub ephemeral: Option<Present>,
    /// In-tree sources csi-translation-lib migrates to CSI drivers.
    pub aws_elastic_block_store: Option<Box<AWSElasticBlockStoreVolumeSource>>,
    pub gce_persistent_disk: Option<Box<GCEPersistentDiskVolumeSource>>,
    pub azure_disk: Option<Box<AzureDiskVolumeSource>>,
    pub azure_file: Option<Box<AzureFileVolumeSource>>,
    pub cinder: Option<Box<CinderVolumeSource>>,
    pub vsphere_volume: Option<Box<VsphereVirtualDiskVolumeSource>>,
    pub portworx_volume: Option<Box<PortworxVolumeSource>>,
    /// The in-tree attachable plugins still built in.
    pub iscsi: Option<Box<ISCSIVolumeSource>>,
    pub fc: Option<Box<FCVolumeSource>>,
}

impl Volume {
    /// Names a claim, or is an inline volume attach/detach attaches.
    pub fn is_read(&self) -> bool {
        self.persistent_volume_claim.is_some()
            || self.ephemeral.is_some()
            || self.aws_elastic_block_store.is_some()
            || self.gce_persistent_disk.is_some()
            || self.azure_disk.is_some()
            || self.azure_file.is_some()
            || self.cinder.is_some()
            || self.vsphere_volume.is_some()
            || self.portworx_volume.is_some()
            || self.iscsi.is_some()
            || self.fc.is_some()
    }
}

/// A field whose presence is all that is read (serde ignores what it holds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Present {}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    pub phase: Option<String>,
    pub container_statuses: Option<Vec<ContainerStatus>>,
    pub init_container_statuses: Option<Vec<ContainerStatus>>,
    pub ephemeral_container_statuses: Option<Vec<ContainerStatus>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ContainerStatus {
    pub name: String,
    pub state: Option<ContainerState>,
}

/// Whether a container runs is all that is read (upstream's `IsPodTerminated`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ContainerState {
    pub running: Option<Present>,
}

impl Pod {
    /// Drops what decoding still keeps but nothing reads: annotations, volumes that name no
    /// claim and are not attachable inline, and the statuses of containers that no longer run (the informer decodes it without
    /// managed fields).
    pub fn trim(&mut self) {
        self.metadata.annotations = None;
        if let Some(volumes) = self.spec.as_mut().and_then(|s| s.volumes.as_mut()) {
            volumes.retain(Volume::is_read);
            volumes.shrink_to_fit();
        }
        if let Some(status) = self.status.as_mut() {
            for list in [
                &mut status.container_statuses,
                &mut status.init_container_statuses,
                &mut status.ephemeral_container_statuses,
            ]
            .into_iter()
            .flatten()
            {
                list.retain(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()));
                list.shrink_to_fit();
            }
        }
    }
}

impl TryFrom<&k8s_openapi::api::core::v1::Pod> for Pod {
    type Error = serde_json::Error;

    /// The same decoding the watch does, from the API type's JSON (tests, and callers holding a
    /// full pod). An error, not a default: an empty pod would name no claim and look finished.
    fn try_from(pod: &k8s_openapi::api::core::v1::Pod) -> Result<Self, Self::Error> {
        serde_json::to_value(pod).and_then(serde_json::from_value)
    }
}

/// What the shared readers (`objects::pod_claims`, `pod_terminated`, …) need of a pod, so the
/// controllers (slim pods) and the agent (full pods, it reads mounts too) share one reading.
pub trait PodRead {
    fn meta(&self) -> &ObjectMeta;
    fn phase(&self) -> Option<&str>;
    /// The claim-bearing volumes in order: `(volume name, Some((claimName, readOnly)))` for a
    /// `persistentVolumeClaim` volume, `(volume name, None)` for a generic ephemeral one.
    fn claim_volumes(&self) -> Vec<(&str, Option<(&str, bool)>)>;
    /// Does any container (init, app or ephemeral) still run?
    fn any_running(&self) -> bool;
}

/// One reading for both types: their field names are the same.
macro_rules! impl_pod_read {
    ($pod:ty) => {
        impl PodRead for $pod {
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }

            fn phase(&self) -> Option<&str> {
                self.status.as_ref()?.phase.as_deref()
            }

            fn claim_volumes(&self) -> Vec<(&str, Option<(&str, bool)>)> {
                let volumes = self.spec.iter().flat_map(|s| s.volumes.iter().flatten());
                volumes
                    .filter_map(
                        |v| match (&v.persistent_volume_claim, v.ephemeral.is_some()) {
                            (Some(src), _) => Some((
                                v.name.as_str(),
                                Some((src.claim_name.as_str(), src.read_only == Some(true))),
                            )),
                            (None, true) => Some((v.name.as_str(), None)),
                            (None, false) => None,
                        },
                    )
                    .collect()
            }

            fn any_running(&self) -> bool {
                self.status.iter().any(|s| {
                    [
                        &s.container_statuses,
                        &s.init_container_statuses,
                        &s.ephemeral_container_statuses,
                    ]
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                })
            }
        }
    };
}

impl_pod_read!(Pod);
impl_pod_read!(k8s_openapi::api::core::v1::Pod);

#[cfg(test)]
mod tests {

    use crate::store::pods::{pod_claims, pod_terminated};
    use crate::store::slim;
    use k8s_openapi::api::core::v1::{
        Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus,
        EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec, PodStatus,
        ProjectedVolumeSource, Volume,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn status(name: &str, running: bool) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            image: "registry.example/app:1".into(),
            state: Some(if running {
                ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                }
            } else {
                ContainerState {
                    terminated: Some(ContainerStateTerminated::default()),
                    ..Default::default()
                }
            }),
            ..Default::default()
        }
    }

    fn pod(running: bool) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        p.metadata.namespace = Some("ns".into());
        p.metadata.uid = Some("u".into());
        p.spec = Some(PodSpec {
            node_name: Some("n1".into()),
            containers: vec![Container {
                name: "app".into(),
                ..Default::default()
            }],
            volumes: Some(vec![
                Volume {
                    name: "data".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: "c".into(),
                        read_only: Some(true),
                    }),
                    ..Default::default()
                },
                Volume {
                    name: "scratch".into(),
                    ephemeral: Some(EphemeralVolumeSource::default()),
                    ..Default::default()
                },
                Volume {
                    name: "kube-api-access".into(),
                    projected: Some(ProjectedVolumeSource::default()),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        });
        p.status = Some(PodStatus {
            phase: Some("Running".into()),
            container_statuses: Some(vec![status("app", running), status("side", false)]),
            ..Default::default()
        });
        p
    }

    /// What the controllers read survives decoding into the slim pod and the trim: claims,
    /// node, phase, and whether a deleted pod still runs a container (a claim or volume in use
    /// must not look free). Both sides go through the shared readers, each on its own type.
    #[test]
    fn a_stripped_pod_answers_what_controllers_ask() {
        for running in [true, false] {
            let mut full = pod(running);
            full.metadata.deletion_timestamp = Some(Time(Default::default()));
            full.metadata.annotations = Some([("a".to_string(), "b".to_string())].into());
            let mut slim = slim::Pod::try_from(&full).unwrap();
            slim.trim();
            assert_eq!(pod_claims(&slim), pod_claims(&full));
            assert_eq!(pod_terminated(&slim), pod_terminated(&full), "running: {running}");
            assert_eq!(pod_terminated(&slim), !running);
            let spec = slim.spec.as_ref().unwrap();
            assert_eq!(spec.node_name.as_deref(), Some("n1"));
            assert_eq!(
                spec.volumes.as_ref().unwrap().len(),
                2,
                "the projected volume went"
            );
            let status = slim.status.as_ref().unwrap();
            assert_eq!(status.phase.as_deref(), Some("Running"));
            assert_eq!(
                status.container_statuses.as_ref().unwrap().len(),
                usize::from(running),
                "only running containers stay"
            );
            assert_eq!(slim.metadata.uid.as_deref(), Some("u"));
            assert_eq!(slim.metadata.annotations, None);
        }
    }

    /// The slim pod decodes a real watch event's JSON (unknown fields skipped, `running: {}`
    /// and a claim template kept as presence) and holds a fraction of the API type's bytes.
    #[test]
    fn a_slim_pod_decodes_the_wire_form_and_is_small() {
        let json = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "x"}],
                     "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c", "readOnly": true}},
                                 {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"]}}}},
                                 {"name": "cfg", "configMap": {"name": "m"}}]},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "app", "ready": true, "restartCount": 0, "image": "x", "imageID": "",
                 "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}
        });
        let full: Pod = serde_json::from_value(json.clone()).unwrap();
        let slim: slim::Pod = serde_json::from_value(json).unwrap();
        assert_eq!(pod_claims(&slim), pod_claims(&full));
        assert_eq!(pod_claims(&slim).len(), 2);
        assert!(
            !pod_terminated(&slim),
            "a deleted pod with a running container holds on"
        );
        assert_eq!(pod_terminated(&slim), pod_terminated(&full));
        assert!(
            std::mem::size_of::<slim::Pod>() * 4 < std::mem::size_of::<Pod>(),
            "slim {} vs full {}",
            std::mem::size_of::<slim::Pod>(),
            std::mem::size_of::<Pod>()
        );
        assert!(std::mem::size_of::<slim::Volume>() * 20 < std::mem::size_of::<Volume>());
    }
}

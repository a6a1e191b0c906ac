//! The state every controller shares: one client, one metrics registry and one informer per
//! resource type, started once when this replica becomes leader.

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

//! The state every controller shares: one client, one metrics registry and one informer per
//! resource type, started once when this replica becomes leader.

use std::sync::Arc;

use crate::metrics::Registry;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStatus, Node, PersistentVolume, PersistentVolumeClaim,
    Pod, PodSpec, PodStatus,
};
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

/// Pods are the biggest objects watched, and most of a pod is nothing a controller here reads:
/// they read the claim volumes (`persistentVolumeClaim`, `ephemeral`), `nodeName`, the phase,
/// deletion state, and whether any container still runs (`objects::pod_terminated`). The rest
/// goes before the pod is stored: a k8s-openapi `Container` or `Volume` is kilobytes even when
/// nearly empty, and at 4,000 pods the copies of containers were the biggest item of the
/// controller's heap. Labels, owners and the UID stay (metadata is small).
fn strip_pod(pod: &mut Pod) {
    strip_managed_fields(pod);
    pod.metadata.annotations = None;
    if let Some(spec) = pod.spec.take() {
        pod.spec = Some(PodSpec {
            node_name: spec.node_name,
            volumes: spec.volumes.map(|vs| {
                vs.into_iter()
                    .filter(|v| v.persistent_volume_claim.is_some() || v.ephemeral.is_some())
                    .collect()
            }),
            ..Default::default()
        });
    }
    if let Some(status) = pod.status.take() {
        pod.status = Some(PodStatus {
            phase: status.phase,
            container_statuses: running_only(status.container_statuses),
            init_container_statuses: running_only(status.init_container_statuses),
            ephemeral_container_statuses: running_only(status.ephemeral_container_statuses),
            ..Default::default()
        });
    }
}

/// The containers that still run, each reduced to its name and that fact: all a deleted pod's
/// statuses are read for (is it terminated, as upstream's `IsPodTerminated` asks).
fn running_only(list: Option<Vec<ContainerStatus>>) -> Option<Vec<ContainerStatus>> {
    list.map(|l| {
        l.into_iter()
            .filter(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            .map(|c| ContainerStatus {
                name: c.name,
                state: Some(ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect()
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects::{pod_claims, pod_terminated};
    use k8s_openapi::api::core::v1::{
        Container, ContainerStateTerminated, EphemeralVolumeSource, PersistentVolumeClaimVolumeSource,
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

    /// What the controllers read survives the trim: claims, node, phase, and whether a deleted
    /// pod still runs a container (a claim or volume in use must not look free).
    #[test]
    fn a_stripped_pod_answers_what_controllers_ask() {
        for running in [true, false] {
            let mut full = pod(running);
            full.metadata.deletion_timestamp = Some(Time(Default::default()));
            let mut slim = full.clone();
            strip_pod(&mut slim);
            assert_eq!(pod_claims(&slim), pod_claims(&full));
            assert_eq!(pod_terminated(&slim), pod_terminated(&full), "running: {running}");
            assert_eq!(pod_terminated(&slim), !running);
            let spec = slim.spec.as_ref().unwrap();
            assert_eq!(spec.node_name.as_deref(), Some("n1"));
            assert!(spec.containers.is_empty());
            assert_eq!(
                spec.volumes.as_ref().unwrap().len(),
                2,
                "the projected volume went"
            );
            assert_eq!(slim.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
            assert_eq!(slim.metadata.uid.as_deref(), Some("u"));
        }
    }
}

//! Reading pods the same way in every controller and the agent. One reader of
//! "which claims does a pod use", so persistentVolumeClaim and generic ephemeral volumes are
//! resolved alike everywhere (upstream: `pkg/volume/util` and `component-helpers/storage/ephemeral`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::store::slim::PodRead;

/// A claim one pod volume names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodClaim {
    /// The pod volume's name.
    pub volume: String,
    /// The claim's name, in the pod's namespace.
    pub claim: String,
    /// A generic ephemeral volume: the claim is `<pod>-<volume>` and must be owned by the pod.
    pub ephemeral: bool,
    /// `persistentVolumeClaim.readOnly` (ephemeral volumes have no such field).
    pub read_only: bool,
}

impl PodClaim {
    /// May `pod` use `claim` for this volume? A persistentVolumeClaim volume may use any claim of
    /// its name; a generic ephemeral one only the claim the pod controls (upstream's
    /// `ephemeral.VolumeIsForPod`): a claim of the same name made by someone else is not it.
    /// Only the claim's metadata is read.
    pub fn usable<P: PodRead + ?Sized>(&self, pod: &P, claim: &ObjectMeta) -> bool {
        !self.ephemeral || claim_is_for_pod(pod, claim)
    }
}

/// The name of the claim of a generic ephemeral volume (upstream's `ephemeral.VolumeClaimName`).
pub fn ephemeral_claim_name(pod: &str, volume: &str) -> String {
    format!("{pod}-{volume}")
}

/// The claims a pod's volumes name, in volume order: `persistentVolumeClaim` volumes by their
/// `claimName`, generic ephemeral volumes by `<pod>-<volume>`. Other volume kinds name no claim.
pub fn pod_claims<P: PodRead + ?Sized>(pod: &P) -> Vec<PodClaim> {
    let pod_name = pod.meta().name.as_deref().unwrap_or_default();
    pod.claim_volumes()
        .into_iter()
        .map(|(volume, source)| match source {
            Some((claim, read_only)) => PodClaim {
                volume: volume.to_string(),
                claim: claim.to_string(),
                ephemeral: false,
                read_only,
            },
            None => PodClaim {
                volume: volume.to_string(),
                claim: ephemeral_claim_name(pod_name, volume),
                ephemeral: true,
                read_only: false,
            },
        })
        .collect()
}

/// Has the pod finished for good (upstream's `util.IsPodTerminated`): Succeeded or Failed, or
/// being deleted with no container running (every status terminated or waiting, or none).
pub fn pod_terminated<P: PodRead + ?Sized>(pod: &P) -> bool {
    if matches!(pod.phase(), Some("Succeeded" | "Failed")) {
        return true;
    }
    pod.meta().deletion_timestamp.is_some() && !pod.any_running()
}

/// Is the claim of metadata `claim` controlled by `pod` (an ownerReference with
/// `controller: true` and the pod's UID)?
pub fn claim_is_for_pod<P: PodRead + ?Sized>(pod: &P, claim: &ObjectMeta) -> bool {
    let Some(uid) = pod.meta().uid.as_deref().filter(|u| !u.is_empty()) else {
        return false;
    };
    claim
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        EmptyDirVolumeSource, EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use super::*;

    fn pod(volumes: Vec<Volume>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                namespace: Some("ns".into()),
                uid: Some("pod-uid".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                volumes: Some(volumes),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn pvc_volume(name: &str, claim: &str, ro: Option<bool>) -> Volume {
        Volume {
            name: name.into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.into(),
                read_only: ro,
            }),
            ..Default::default()
        }
    }

    fn ephemeral_volume(name: &str) -> Volume {
        Volume {
            name: name.into(),
            ephemeral: Some(EphemeralVolumeSource::default()),
            ..Default::default()
        }
    }

    /// A claim's metadata: all that deciding its use reads.
    fn claim(owners: Vec<OwnerReference>) -> ObjectMeta {
        ObjectMeta {
            name: Some("web-0-scratch".into()),
            owner_references: Some(owners),
            ..Default::default()
        }
    }

    fn owner(uid: &str, controller: Option<bool>) -> OwnerReference {
        OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "web-0".into(),
            uid: uid.into(),
            controller,
            ..Default::default()
        }
    }

    #[test]
    fn both_kinds_of_claim_volume_in_order_others_skipped() {
        let p = pod(vec![
            pvc_volume("data", "data-claim", Some(true)),
            Volume {
                name: "tmp".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            },
            ephemeral_volume("scratch"),
            pvc_volume("logs", "logs-claim", None),
        ]);
        let got = pod_claims(&p);
        assert_eq!(
            got,
            vec![
                PodClaim {
                    volume: "data".into(),
                    claim: "data-claim".into(),
                    ephemeral: false,
                    read_only: true
                },
                PodClaim {
                    volume: "scratch".into(),
                    claim: "web-0-scratch".into(),
                    ephemeral: true,
                    read_only: false
                },
                PodClaim {
                    volume: "logs".into(),
                    claim: "logs-claim".into(),
                    ephemeral: false,
                    read_only: false
                },
            ]
        );
    }

    #[test]
    fn a_pod_without_spec_or_volumes_names_no_claim() {
        let mut p = pod(vec![]);
        assert!(pod_claims(&p).is_empty());
        p.spec = None;
        assert!(pod_claims(&p).is_empty());
    }

    #[test]
    fn an_ephemeral_claim_counts_only_when_the_pod_controls_it() {
        let p = pod(vec![ephemeral_volume("scratch")]);
        let pc = &pod_claims(&p)[0];
        assert!(pc.usable(&p, &claim(vec![owner("pod-uid", Some(true))])));
        // Same name, made by someone else, or owned without being the controller: not ours.
        assert!(!pc.usable(&p, &claim(vec![owner("other-uid", Some(true))])));
        assert!(!pc.usable(&p, &claim(vec![owner("pod-uid", None)])));
        assert!(!pc.usable(&p, &claim(vec![])));
        // A pod without a UID (never stored) controls nothing.
        let mut no_uid = p.clone();
        no_uid.metadata.uid = None;
        assert!(!pc.usable(&no_uid, &claim(vec![owner("", Some(true))])));
    }

    #[test]
    fn a_persistent_claim_is_usable_whoever_owns_it() {
        let p = pod(vec![pvc_volume("data", "data-claim", None)]);
        let pc = &pod_claims(&p)[0];
        assert!(pc.usable(&p, &claim(vec![])));
        assert!(pc.usable(&p, &claim(vec![owner("other-uid", Some(true))])));
    }
}

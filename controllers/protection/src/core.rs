//! The pure part: who uses a claim, and what to do with a claim's or a volume's protection
//! finalizer. No I/O, no clock; the async layer feeds snapshots in and carries the answer out.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use stowage_common::store::StoredPod;
use stowage_common::store::pods::pod_claims;

/// Put on every claim by the apiserver's StorageObjectInUseProtection admission.
pub const PVC_FINALIZER: &str = "kubernetes.io/pvc-protection";
/// Put on every volume by the same admission plugin.
pub const PV_FINALIZER: &str = "kubernetes.io/pv-protection";

/// A pod that still uses a claim, as named in events and logs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodRef {
    pub name: String,
    pub uid: String,
}

impl PodRef {
    pub fn of(pod: &StoredPod) -> Self {
        Self {
            name: pod.meta().name.clone().unwrap_or_default(),
            uid: pod.meta().uid.clone().unwrap_or_default(),
        }
    }
}

/// What one sync of one object should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The object is as it should be (or its finalizer is someone else's business now).
    Nothing,
    /// A live object lacks the finalizer (created before the admission plugin was on).
    AddFinalizer,
    /// Being deleted and nothing protects it any more.
    RemoveFinalizer,
    /// A claim being deleted that these pods still use (sorted, no duplicates).
    WaitForPods(Vec<PodRef>),
    /// A volume being deleted that is still Bound.
    WaitForUnbind,
}

fn has(finalizers: Option<&Vec<String>>, f: &str) -> bool {
    finalizers.is_some_and(|v| v.iter().any(|x| x == f))
}

/// The decision for a claim given the pods that use it (already filtered by `pod_uses_claim`).
/// Only the claim's metadata matters, so a stored claim is decided without decoding it.
pub fn decide_pvc(meta: &ObjectMeta, users: &[PodRef]) -> Action {
    let protected = has(meta.finalizers.as_ref(), PVC_FINALIZER);
    match (meta.deletion_timestamp.is_some(), protected) {
        (true, true) if users.is_empty() => Action::RemoveFinalizer,
        (true, true) => {
            let mut u = users.to_vec();
            u.sort();
            u.dedup();
            Action::WaitForPods(u)
        }
        // Deleting and no longer ours; a finalizer cannot be added to an object being deleted.
        (true, false) => Action::Nothing,
        (false, false) => Action::AddFinalizer,
        (false, true) => Action::Nothing,
    }
}

/// The decision for a volume: it stays while Bound.
pub fn decide_pv(pv: &PersistentVolume) -> Action {
    decide_pv_of(&pv.metadata, pv.status.as_ref().and_then(|s| s.phase.as_deref()))
}

/// [`decide_pv`] from the only fields it reads: the metadata and `status.phase`.
pub fn decide_pv_of(meta: &ObjectMeta, phase: Option<&str>) -> Action {
    let protected = has(meta.finalizers.as_ref(), PV_FINALIZER);
    let bound = phase == Some("Bound");
    match (meta.deletion_timestamp.is_some(), protected) {
        (true, true) if bound => Action::WaitForUnbind,
        (true, true) => Action::RemoveFinalizer,
        (true, false) => Action::Nothing,
        (false, false) => Action::AddFinalizer,
        (false, true) => Action::Nothing,
    }
}

/// Whether a change of this object can lead to an action (cheap filter before queueing).
pub fn pvc_needs_sync(meta: &ObjectMeta) -> bool {
    decide_pvc(meta, &[]) != Action::Nothing
}

/// A pod the kubelet is done with, or that was force-deleted: deleted with a zero grace period
/// (upstream's `podIsShutDown`). It only waits for its own finalizers, so counting it as the user
/// of its generic ephemeral claim could deadlock a pod finalizer that waits for that claim.
pub fn pod_is_shut_down(pod: &StoredPod) -> bool {
    pod.meta().deletion_timestamp.is_some() && pod.meta().deletion_grace_period_seconds == Some(0)
}

/// The names of the claims a pod refers to, in its own namespace: plain claim volumes and the
/// `<pod>-<volume>` claims of generic ephemeral volumes (the shared reader,
/// `stowage_common::store::pods::pod_claims`). Used to index pods by claim.
pub fn claim_names(pod: &StoredPod) -> Vec<String> {
    let mut out: Vec<String> = pod_claims(pod).into_iter().map(|c| c.claim).collect();
    out.sort();
    out.dedup();
    out
}

/// Whether `pod` uses `pvc`, by upstream's rule (`podUsesPVCForDeletion`): a pod scheduled to a
/// node that names the claim in a `persistentVolumeClaim` volume, whatever its phase or deletion
/// state (a Succeeded, Failed or force-deleted pod may still have the volume mounted on its node
/// until the kubelet has torn it down and the pod object is gone); a generic ephemeral volume's
/// claim only while the pod owns it and is not shut down (`pod_is_shut_down`). A pod not yet
/// scheduled never counts: the scheduler will not place a pod whose claim is being deleted, so
/// counting it would keep the claim for ever (a StatefulSet's pod pending for a claim it then
/// recreates waits on exactly that).
pub fn pod_uses_claim(pod: &StoredPod, pvc: &PersistentVolumeClaim) -> bool {
    if pod.meta().namespace != pvc.metadata.namespace || pod.node_name().is_none() {
        return false;
    }
    let Some(claim) = pvc.metadata.name.as_deref() else {
        return false;
    };
    pod_claims(pod).iter().any(|c| {
        c.claim == claim && (!c.ephemeral || (!pod_is_shut_down(pod) && c.usable(pod, &pvc.metadata)))
    })
}

/// The live users of `pvc` among `pods`, sorted.
pub fn users<'a>(pvc: &PersistentVolumeClaim, pods: impl IntoIterator<Item = &'a StoredPod>) -> Vec<PodRef> {
    let mut u: Vec<PodRef> = pods
        .into_iter()
        .filter(|p| pod_uses_claim(p, pvc))
        .map(PodRef::of)
        .collect();
    u.sort();
    u.dedup();
    u
}

/// The note of the event on a claim whose deletion waits: names the pods, bounded so the note
/// stays under the Event API's 1 KiB limit.
pub fn waiting_note(users: &[PodRef]) -> String {
    const SHOWN: usize = 10;
    let names: Vec<&str> = users.iter().take(SHOWN).map(|u| u.name.as_str()).collect();
    let mut note = format!(
        "deletion waits until no pod uses the claim; used by {}",
        names.join(", ")
    );
    if users.len() > SHOWN {
        note.push_str(&format!(" and {} more", users.len() - SHOWN));
    }
    stowage_common::observe::events::bounded_note(note)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        EphemeralVolumeSource, PersistentVolumeClaimVolumeSource, PersistentVolumeStatus, Pod as FullPod,
        PodSpec, PodStatus, Volume,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use kube::Resource;
    use kube::api::ObjectMeta;
    use proptest::prelude::*;

    fn ts() -> Time {
        Time(Default::default())
    }

    fn claim(name: &str, deleting: bool, finalizer: bool) -> PersistentVolumeClaim {
        PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                deletion_timestamp: deleting.then(ts),
                finalizers: finalizer.then(|| vec!["other".into(), PVC_FINALIZER.into()]),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn volume(name: &str, phase: Option<&str>, deleting: bool, finalizer: bool) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some(name.into()),
                deletion_timestamp: deleting.then(ts),
                finalizers: finalizer.then(|| vec![PV_FINALIZER.into()]),
                ..Default::default()
            },
            status: Some(PersistentVolumeStatus {
                phase: phase.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[derive(Debug, Clone)]
    enum Vol {
        Claim(String),
        Ephemeral(String),
        Other(String),
    }

    /// A pod scheduled to node `n1`.
    fn pod(name: &str, uid: &str, phase: Option<&str>, vols: &[Vol]) -> StoredPod {
        pod_on(name, uid, phase, vols, Some("n1"))
    }

    fn pod_on(name: &str, uid: &str, phase: Option<&str>, vols: &[Vol], node: Option<&str>) -> StoredPod {
        let volumes = vols
            .iter()
            .map(|v| match v {
                Vol::Claim(c) => Volume {
                    name: format!("v-{c}"),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: c.clone(),
                        read_only: None,
                    }),
                    ..Default::default()
                },
                Vol::Ephemeral(n) => Volume {
                    name: n.clone(),
                    ephemeral: Some(EphemeralVolumeSource::default()),
                    ..Default::default()
                },
                Vol::Other(n) => Volume {
                    name: n.clone(),
                    ..Default::default()
                },
            })
            .collect();
        // Built as the API type, stored as the informer decodes it.
        StoredPod::from_pod(&FullPod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                volumes: Some(volumes),
                node_name: node.map(Into::into),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: phase.map(Into::into),
                ..Default::default()
            }),
        })
        .unwrap()
    }

    fn owned(mut c: PersistentVolumeClaim, uid: &str) -> PersistentVolumeClaim {
        c.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "p".into(),
            uid: uid.into(),
            controller: Some(true),
            ..Default::default()
        }]);
        c
    }

    #[test]
    fn running_pod_keeps_deleted_claim() {
        let c = claim("data", true, true);
        let p = pod("p", "u1", Some("Running"), &[Vol::Claim("data".into())]);
        let u = users(&c, [&p]);
        assert_eq!(
            decide_pvc(&c.metadata, &u),
            Action::WaitForPods(vec![PodRef {
                name: "p".into(),
                uid: "u1".into()
            }])
        );
    }

    #[test]
    fn finished_or_force_deleted_pods_still_hold_a_named_claim() {
        let c = claim("data", true, true);
        for phase in ["Succeeded", "Failed"] {
            let p = pod("p", "u1", Some(phase), &[Vol::Claim("data".into())]);
            assert!(pod_uses_claim(&p, &c), "{phase}");
            assert!(
                matches!(decide_pvc(&c.metadata, &users(&c, [&p])), Action::WaitForPods(_)),
                "{phase}"
            );
        }
        let mut p = pod("p", "u1", Some("Running"), &[Vol::Claim("data".into())]);
        p.meta_mut().deletion_timestamp = Some(ts());
        p.meta_mut().deletion_grace_period_seconds = Some(30);
        assert!(
            pod_uses_claim(&p, &c),
            "a pod still in its grace period uses the claim"
        );
        p.meta_mut().deletion_grace_period_seconds = Some(0);
        assert!(
            pod_uses_claim(&p, &c),
            "force-deleted but still there (finalizers): its volume may still be mounted"
        );
    }

    #[test]
    fn a_shut_down_pod_releases_only_its_ephemeral_claim() {
        let c = owned(claim("p-scratch", true, true), "u1");
        for phase in ["Succeeded", "Failed", "Running"] {
            let p = pod("p", "u1", Some(phase), &[Vol::Ephemeral("scratch".into())]);
            assert!(pod_uses_claim(&p, &c), "{phase}: not shut down");
        }
        let mut p = pod("p", "u1", Some("Running"), &[Vol::Ephemeral("scratch".into())]);
        p.meta_mut().deletion_timestamp = Some(ts());
        p.meta_mut().deletion_grace_period_seconds = Some(30);
        assert!(pod_uses_claim(&p, &c), "in its grace period");
        p.meta_mut().deletion_grace_period_seconds = Some(0);
        assert!(!pod_uses_claim(&p, &c), "shut down");
        assert_eq!(decide_pvc(&c.metadata, &users(&c, [&p])), Action::RemoveFinalizer);
    }

    /// Upstream's StatefulSet test "PVC should be recreated when pod is pending due to missing
    /// PVC": the pod is recreated while its node is cordoned, so it stays Pending, and its claim
    /// is deleted. The scheduler refuses a pod whose claim is being deleted; had the pending pod
    /// counted, the claim would never have gone and the StatefulSet could not recreate it.
    #[test]
    fn an_unscheduled_pod_does_not_hold_a_claim_being_deleted() {
        let c = claim("data", true, true);
        let pending = pod_on("p", "u1", Some("Pending"), &[Vol::Claim("data".into())], None);
        assert!(!pod_uses_claim(&pending, &c));
        assert_eq!(
            decide_pvc(&c.metadata, &users(&c, [&pending])),
            Action::RemoveFinalizer
        );
        let scheduled = pod("p", "u1", Some("Pending"), &[Vol::Claim("data".into())]);
        assert!(pod_uses_claim(&scheduled, &c), "once scheduled it does");
    }

    #[test]
    fn ephemeral_claim_counts_only_when_owned_by_the_pod() {
        let p = pod("web", "u1", Some("Running"), &[Vol::Ephemeral("scratch".into())]);
        assert_eq!(claim_names(&p), vec!["web-scratch".to_string()]);
        let c = claim("web-scratch", true, true);
        assert!(!pod_uses_claim(&p, &c), "not owned");
        assert!(!pod_uses_claim(&p, &owned(c.clone(), "other-uid")));
        assert!(pod_uses_claim(&p, &owned(c, "u1")));
        // The name split must be exact: pod "web" volume "scratch" is not claim "web-scratch2".
        assert!(!pod_uses_claim(
            &p,
            &owned(claim("web-scratch2", true, true), "u1")
        ));
    }

    #[test]
    fn other_namespace_does_not_count() {
        let c = claim("data", true, true);
        let mut p = pod("p", "u1", Some("Running"), &[Vol::Claim("data".into())]);
        p.meta_mut().namespace = Some("elsewhere".into());
        assert!(!pod_uses_claim(&p, &c));
    }

    #[test]
    fn claim_finalizer_is_added_only_to_live_claims() {
        assert_eq!(
            decide_pvc(&claim("a", false, false).metadata, &[]),
            Action::AddFinalizer
        );
        assert_eq!(
            decide_pvc(&claim("a", true, false).metadata, &[]),
            Action::Nothing
        );
        assert_eq!(
            decide_pvc(&claim("a", false, true).metadata, &[]),
            Action::Nothing
        );
    }

    #[test]
    fn volume_decisions() {
        assert_eq!(
            decide_pv(&volume("v", Some("Bound"), true, true)),
            Action::WaitForUnbind
        );
        for phase in [
            None,
            Some("Available"),
            Some("Released"),
            Some("Failed"),
            Some("Pending"),
        ] {
            assert_eq!(
                decide_pv(&volume("v", phase, true, true)),
                Action::RemoveFinalizer,
                "{phase:?}"
            );
        }
        assert_eq!(
            decide_pv(&volume("v", Some("Bound"), false, false)),
            Action::AddFinalizer
        );
        assert_eq!(
            decide_pv(&volume("v", Some("Bound"), true, false)),
            Action::Nothing
        );
    }

    #[test]
    fn note_is_bounded_and_names_pods() {
        let u: Vec<PodRef> = (0..200)
            .map(|i| PodRef {
                name: format!("pod-{i:03}-{}", "x".repeat(60)),
                uid: i.to_string(),
            })
            .collect();
        let n = waiting_note(&u);
        assert!(n.len() <= 1000, "{}", n.len());
        assert!(n.contains("pod-000"));
        let n = waiting_note(&u[..2]);
        assert!(n.contains(&u[0].name) && n.contains(&u[1].name), "{n}");
    }

    fn arb_vol() -> impl Strategy<Value = Vol> {
        prop_oneof![
            (0u8..4).prop_map(|i| Vol::Claim(format!("c{i}"))),
            (0u8..3).prop_map(|i| Vol::Ephemeral(format!("e{i}"))),
            Just(Vol::Other("cfg".into())),
        ]
    }

    fn arb_pod() -> impl Strategy<Value = StoredPod> {
        (
            0u8..4,
            prop_oneof![
                Just(None),
                Just(Some("Pending")),
                Just(Some("Running")),
                Just(Some("Succeeded")),
                Just(Some("Failed"))
            ],
            proptest::collection::vec(arb_vol(), 0..4),
            proptest::option::of(0i64..2),
            any::<bool>(),
        )
            .prop_map(|(i, phase, vols, grace, scheduled)| {
                let node = scheduled.then_some("n1");
                let mut p = pod_on(&format!("p{i}"), &format!("u{i}"), phase, &vols, node);
                if let Some(g) = grace {
                    p.meta_mut().deletion_timestamp = Some(ts());
                    p.meta_mut().deletion_grace_period_seconds = Some(g);
                }
                p
            })
    }

    fn arb_claim() -> impl Strategy<Value = PersistentVolumeClaim> {
        (
            prop_oneof![
                (0u8..4).prop_map(|i| format!("c{i}")),
                (0u8..4, 0u8..3).prop_map(|(p, e)| format!("p{p}-e{e}"))
            ],
            any::<bool>(),
            any::<bool>(),
            proptest::option::of(0u8..4),
        )
            .prop_map(|(name, deleting, fin, owner)| {
                let c = claim(&name, deleting, fin);
                match owner {
                    Some(o) => owned(c, &format!("u{o}")),
                    None => c,
                }
            })
    }

    proptest! {
        /// The claim's finalizer goes only when it is being deleted and no pod uses it: none
        /// names it, and none that is not shut down has it as its own ephemeral claim.
        #[test]
        fn never_removes_a_claim_a_live_pod_uses(c in arb_claim(), pods in proptest::collection::vec(arb_pod(), 0..6)) {
            let u = users(&c, &pods);
            let action = decide_pvc(&c.metadata, &u);
            let name = c.metadata.name.clone().unwrap();
            // Upstream's rule, for scheduled pods only: a named claim whatever the pod's state;
            // an owned ephemeral claim unless the pod is shut down (deleted with a zero grace
            // period).
            let live_user = pods.iter().filter(|p| p.node_name().is_some()).any(|p| {
                let shut_down = p.meta().deletion_timestamp.is_some() && p.meta().deletion_grace_period_seconds == Some(0);
                p.volumes().iter().any(|v| {
                    v.persistent_volume_claim.as_ref().is_some_and(|s| s.claim_name == name)
                        || (!shut_down
                            && v.ephemeral.is_some()
                            && format!("{}-{}", p.meta().name.as_ref().unwrap(), v.name) == name
                            && c.metadata.owner_references.iter().flatten().any(|o| Some(&o.uid) == p.meta().uid.as_ref()))
                })
            });
            if action == Action::RemoveFinalizer {
                prop_assert!(!live_user);
                prop_assert!(c.metadata.deletion_timestamp.is_some());
            }
            if live_user && c.metadata.deletion_timestamp.is_some() && has(c.metadata.finalizers.as_ref(), PVC_FINALIZER) {
                prop_assert_eq!(action, Action::WaitForPods(u));
            }
        }

        /// Every user found by `users` is indexed under the claim's name (so the index lookup
        /// can never miss a user the full scan would find).
        #[test]
        fn users_are_indexed_under_the_claim(c in arb_claim(), pods in proptest::collection::vec(arb_pod(), 0..6)) {
            let name = c.metadata.name.clone().unwrap();
            for p in pods.iter().filter(|p| pod_uses_claim(p, &c)) {
                prop_assert!(claim_names(p).contains(&name));
            }
        }

        /// Carrying out the action reaches a fixed point: a second decision on the result is
        /// `Nothing` or the same wait.
        #[test]
        fn actions_converge(c in arb_claim(), pods in proptest::collection::vec(arb_pod(), 0..6)) {
            let u = users(&c, &pods);
            let mut after = c.clone();
            match decide_pvc(&c.metadata, &u) {
                Action::AddFinalizer => after.metadata.finalizers.get_or_insert_with(Vec::new).push(PVC_FINALIZER.into()),
                Action::RemoveFinalizer => after.metadata.finalizers.get_or_insert_with(Vec::new).retain(|f| f != PVC_FINALIZER),
                Action::WaitForPods(w) => { prop_assert!(!w.is_empty()); prop_assert_eq!(decide_pvc(&after.metadata, &u), Action::WaitForPods(w)); return Ok(()); }
                Action::Nothing => {}
                Action::WaitForUnbind => prop_assert!(false, "not a claim action"),
            }
            let again = decide_pvc(&after.metadata, &u);
            prop_assert_eq!(again, Action::Nothing);
        }

        /// A Bound volume never loses its finalizer; a deleting volume never gains one.
        #[test]
        fn volume_safety(phase in prop_oneof![Just(None), Just(Some("Bound")), Just(Some("Released")), Just(Some("Available"))],
                         deleting in any::<bool>(), fin in any::<bool>()) {
            let v = volume("v", phase, deleting, fin);
            let a = decide_pv(&v);
            if phase == Some("Bound") { prop_assert_ne!(&a, &Action::RemoveFinalizer); }
            if deleting { prop_assert_ne!(&a, &Action::AddFinalizer); }
            if a == Action::RemoveFinalizer { prop_assert!(deleting && fin); }
        }
    }
}

//! Upstream fidelity of the claim status and the default class,
//! as pure functions: objects in, the status upstream's updateClaimStatus writes out.

use k8s_openapi::api::core::v1::{PersistentVolumeClaimStatus, PersistentVolumeSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::jiff::Timestamp;
use stowage_testkit::builders::{pv, pvc};

use crate::core::{bound_claim_status, newest_default_class, with_claim_phase};

#[test]
fn binding_sets_the_current_volume_attributes_class_of_the_volume() {
    let mut v = pv("v").build();
    v.spec
        .get_or_insert_with(PersistentVolumeSpec::default)
        .volume_attributes_class_name = Some("gold".into());
    let c = pvc("ns", "c").build();
    let bound = bound_claim_status(&c, &v).expect("a bind writes the claim status");
    let st = bound.status.unwrap();
    assert_eq!(st.phase.as_deref(), Some("Bound"));
    assert_eq!(st.current_volume_attributes_class_name.as_deref(), Some("gold"));
    // A bound claim whose volume's class changed follows it.
    let mut again = bound_claim_status(&c, &v).unwrap();
    again
        .status
        .as_mut()
        .unwrap()
        .current_volume_attributes_class_name = Some("silver".into());
    assert!(bound_claim_status(&again, &v).is_some());
}

#[test]
fn pending_and_lost_clear_what_described_the_volume() {
    for phase in ["Pending", "Lost"] {
        let mut c = pvc("ns", "c").build();
        c.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            capacity: Some([("storage".to_string(), Quantity("1Gi".into()))].into()),
            current_volume_attributes_class_name: Some("gold".into()),
            ..Default::default()
        });
        let st = with_claim_phase(&c, phase).unwrap().status.unwrap();
        assert_eq!(st.phase.as_deref(), Some(phase));
        assert_eq!(st.access_modes, None, "{phase}");
        assert_eq!(st.capacity, None, "{phase}");
        assert_eq!(st.current_volume_attributes_class_name, None, "{phase}");
        // Written once: the cleared status needs nothing more.
        let mut done = c.clone();
        done.status = Some(st);
        assert!(with_claim_phase(&done, phase).is_none());
    }
}

#[test]
fn the_default_class_is_the_newest_then_the_first_by_name() {
    let t = |s: i64| Some(Timestamp::from_second(s).unwrap());
    let pick = |v: Vec<(Option<Timestamp>, &str)>| {
        newest_default_class(v.into_iter().map(|(t, n)| (t, n.to_string())))
    };
    assert_eq!(pick(vec![(t(10), "old"), (t(20), "new")]).as_deref(), Some("new"));
    // Created in the same second: name ascending (upstream sorts so).
    assert_eq!(
        pick(vec![(t(20), "b"), (t(20), "a"), (t(10), "0")]).as_deref(),
        Some("a")
    );
    assert_eq!(pick(vec![]), None);
}

// --- Items 1, 4, 6, 9 and 10: decisions over a cache, as upstream's syncClaim/syncVolume ---

mod sync {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use k8s_openapi::api::core::v1::{
        HostPathVolumeSource, PersistentVolume, PersistentVolumeClaim, PersistentVolumeStatus,
    };
    use k8s_openapi::api::core::v1::{TopologySelectorLabelRequirement, TopologySelectorTerm};
    use k8s_openapi::api::storage::v1::StorageClass;
    use kube::ResourceExt;
    use stowage_testkit::builders::{pv, pvc, storage_class};

    use crate::core::{Action, Cache, Env, PodUse, Target, sync_claim, sync_volume};
    use crate::pv::*;

    fn classes(name: &str) -> Option<Arc<StorageClass>> {
        Some(Arc::new(match name {
            "gp2" => storage_class("gp2", "kubernetes.io/aws-ebs").build(),
            "local" => storage_class("local", "kubernetes.io/no-provisioner")
                .wait_for_first_consumer()
                .build(),
            "wffc" => storage_class("wffc", "example.com/csi")
                .wait_for_first_consumer()
                .build(),
            "zoned" => {
                let mut c = storage_class("zoned", LOOP_DRIVER)
                    .wait_for_first_consumer()
                    .build();
                c.allowed_topologies = Some(vec![TopologySelectorTerm {
                    match_label_expressions: Some(vec![TopologySelectorLabelRequirement {
                        key: "zone".into(),
                        values: vec!["a".into()],
                    }]),
                }]);
                c
            }
            "fast" => storage_class("fast", "example.com/csi").build(),
            _ => return None,
        }))
    }

    fn nodes(name: &str) -> Option<BTreeMap<String, String>> {
        match name {
            "node-a" => Some(BTreeMap::from([("zone".into(), "a".into())])),
            "node-b" => Some(BTreeMap::from([("zone".into(), "b".into())])),
            _ => None,
        }
    }

    fn no_room(_: &str) -> Vec<(String, u128)> {
        vec![]
    }

    fn no_pods(_: &str) -> Vec<PodUse> {
        vec![]
    }

    fn with<'a>(pods: &'a dyn Fn(&str) -> Vec<PodUse>) -> Env<'a> {
        Env {
            class: &classes,
            default_class: None,
            node_labels: &nodes,
            pods_of: pods,
            local: false,
            room: &no_room,
            publishing: &|| false,
        }
    }

    fn cache(pvs: &[PersistentVolume], claims: &[PersistentVolumeClaim]) -> Cache {
        let mut c = Cache::default();
        for p in pvs {
            c.put_pv(Arc::new(p.clone()));
        }
        for cl in claims {
            c.put_claim(Arc::new(cl.clone()));
        }
        c
    }

    fn with_uid(mut c: PersistentVolumeClaim, uid: &str) -> PersistentVolumeClaim {
        c.metadata.uid = Some(uid.into());
        c
    }

    fn phase(mut v: PersistentVolume, p: &str) -> PersistentVolume {
        v.status = Some(PersistentVolumeStatus {
            phase: Some(p.into()),
            ..Default::default()
        });
        v
    }

    /// A volume made by hand on a node's disk: no CSI driver, so no external deleter.
    fn host_path(name: &str) -> PersistentVolume {
        let mut v = pv(name)
            .reclaim("Delete")
            .claim_ref("ns", "gone", "uid-gone")
            .build();
        let spec = v.spec.as_mut().unwrap();
        spec.csi = None;
        spec.host_path = Some(HostPathVolumeSource {
            path: "/data/v".into(),
            type_: None,
        });
        v
    }

    fn events(actions: &[Action]) -> Vec<(bool, &'static str, String)> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Event(e) => Some((e.warning, e.reason, e.note.clone())),
                _ => None,
            })
            .collect()
    }

    /// An `Action::Annotate`'s target, annotations set, removed, and finalizers dropped.
    type Edit<'a> = (
        &'a Target,
        &'a BTreeMap<String, String>,
        &'a Vec<String>,
        &'a Vec<String>,
    );

    fn annotate(actions: &[Action]) -> Option<Edit<'_>> {
        actions.iter().find_map(|a| match a {
            Action::Annotate {
                target,
                set,
                remove,
                drop_finalizers,
                ..
            } => Some((target, set, remove, drop_finalizers)),
            _ => None,
        })
    }

    #[test]
    fn a_claim_of_an_in_tree_class_goes_to_the_csi_driver_it_migrated_to() {
        let c = with_uid(pvc("ns", "c").class("gp2").build(), "u1");
        let out = sync_claim(&c, &cache(&[], std::slice::from_ref(&c)), &with(&no_pods));
        assert!(
            out.contains(&Action::SetProvisioner {
                claim: "ns/c".into(),
                provisioner: "ebs.csi.aws.com".into()
            }),
            "{out:?}"
        );
        let ev = events(&out);
        assert!(
            ev.iter()
                .any(|(w, r, n)| !w && *r == "ExternalProvisioning" && n.contains("'ebs.csi.aws.com'")),
            "{ev:?}"
        );
        assert!(ev.iter().all(|(_, r, _)| *r != "ProvisioningFailed"), "{ev:?}");
        // A class with no CSI successor still reports the missing plugin.
        let local = with_uid(pvc("ns", "l").class("local").build(), "u2");
        let mut sel = local.clone();
        sel.annotations_mut()
            .insert(ANN_SELECTED_NODE.into(), "node-a".into());
        let out = sync_claim(&sel, &cache(&[], std::slice::from_ref(&sel)), &with(&no_pods));
        assert!(
            events(&out)
                .iter()
                .any(|(w, r, n)| *w && *r == "ProvisioningFailed" && n.contains("no volume plugin matched")),
            "{out:?}"
        );
    }

    #[test]
    fn claims_and_volumes_of_migrated_plugins_are_marked_and_lose_the_in_tree_finalizer() {
        // A claim an older controller annotated with the in-tree name.
        let c = with_uid(
            pvc("ns", "c")
                .class("gp2")
                .annotation(ANN_STORAGE_PROVISIONER, "kubernetes.io/gce-pd")
                .build(),
            "u1",
        );
        let out = sync_claim(&c, &cache(&[], std::slice::from_ref(&c)), &with(&no_pods));
        let (t, set, _, _) = annotate(&out).expect("claim gets migrated-to");
        assert_eq!(t, &Target::Claim("ns/c".into()));
        assert_eq!(
            set.get(ANN_MIGRATED_TO).map(String::as_str),
            Some("pd.csi.storage.gke.io")
        );

        // A volume the in-tree plugin made, with its deletion finalizer, Released.
        let mut v = phase(
            pv("pvc-1")
                .reclaim("Delete")
                .claim_ref("ns", "gone", "uid-gone")
                .annotation(ANN_PROVISIONED_BY, "kubernetes.io/aws-ebs")
                .build(),
            "Released",
        );
        v.metadata.finalizers = Some(vec![FINALIZER_IN_TREE_PROTECTION.into()]);
        let out = sync_volume(&v, &cache(std::slice::from_ref(&v), &[]), &with(&no_pods));
        let (t, set, _, dropped) = annotate(&out).expect("volume gets migrated-to");
        assert_eq!(t, &Target::Volume("pvc-1".into()));
        assert_eq!(
            set.get(ANN_MIGRATED_TO).map(String::as_str),
            Some("ebs.csi.aws.com")
        );
        assert_eq!(dropped, &vec![FINALIZER_IN_TREE_PROTECTION.to_string()]);
        // Its external-provisioner deletes it: no Failed, no VolumeFailedDelete.
        assert!(
            out.iter()
                .all(|a| !matches!(a, Action::VolumePhase { .. } | Action::Event(_))),
            "{out:?}"
        );

        // Marked by mistake (the recorded provisioner is not in-tree): the mark goes.
        let wrong = pv("w")
            .annotation(ANN_PROVISIONED_BY, "ebs.csi.aws.com")
            .annotation(ANN_MIGRATED_TO, "ebs.csi.aws.com")
            .build();
        let out = sync_volume(&wrong, &cache(std::slice::from_ref(&wrong), &[]), &with(&no_pods));
        assert_eq!(
            annotate(&out).map(|a| a.2.clone()),
            Some(vec![ANN_MIGRATED_TO.to_string()])
        );
        // A plugin that was not migrated: the PV may not vanish before its storage (Delete),
        // the guard goes with Retain, and external-provisioner's guard is not its business.
        let in_tree = pv("h")
            .reclaim("Delete")
            .annotation(ANN_PROVISIONED_BY, "kubernetes.io/host-path")
            .build();
        let out = sync_volume(
            &in_tree,
            &cache(std::slice::from_ref(&in_tree), &[]),
            &with(&no_pods),
        );
        let added = out.iter().find_map(|a| match a {
            Action::Annotate { add_finalizers, .. } => Some(add_finalizers.clone()),
            _ => None,
        });
        assert_eq!(added, Some(vec![FINALIZER_IN_TREE_PROTECTION.to_string()]));
        let mut kept = pv("k")
            .reclaim("Retain")
            .annotation(ANN_PROVISIONED_BY, "kubernetes.io/host-path")
            .build();
        kept.metadata.finalizers = Some(vec![
            FINALIZER_IN_TREE_PROTECTION.into(),
            FINALIZER_EXTERNAL_PROTECTION.into(),
        ]);
        let out = sync_volume(&kept, &cache(std::slice::from_ref(&kept), &[]), &with(&no_pods));
        assert_eq!(
            annotate(&out).map(|a| a.3.clone()),
            Some(vec![
                FINALIZER_IN_TREE_PROTECTION.to_string(),
                FINALIZER_EXTERNAL_PROTECTION.to_string()
            ])
        );
        // A static volume records no provisioner: left alone.
        let fixed = pv("s").build();
        let out = sync_volume(&fixed, &cache(std::slice::from_ref(&fixed), &[]), &with(&no_pods));
        assert!(annotate(&out).is_none(), "{out:?}");
    }

    #[test]
    fn a_released_hand_made_delete_volume_nobody_can_delete_fails_once() {
        let v = phase(host_path("hp"), "Released");
        let out = sync_volume(&v, &cache(std::slice::from_ref(&v), &[]), &with(&no_pods));
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::VolumePhase { phase: "Failed", .. })),
            "{out:?}"
        );
        let ev = events(&out);
        assert!(
            ev.iter().any(|(w, r, n)| *w
                && *r == "VolumeFailedDelete"
                && n.contains("no deletable volume plugin matched")),
            "{ev:?}"
        );
        // Failed already: nothing more (one event per phase change, as upstream).
        let f = phase(host_path("hp"), "Failed");
        assert!(sync_volume(&f, &cache(std::slice::from_ref(&f), &[]), &with(&no_pods)).is_empty());
        // Another CSI driver's volume: its external provisioner's business, silently.
        let other = phase(
            pv("csi")
                .driver("example.com/csi", "h")
                .reclaim("Delete")
                .claim_ref("ns", "gone", "uid-gone")
                .build(),
            "Released",
        );
        assert!(sync_volume(&other, &cache(std::slice::from_ref(&other), &[]), &with(&no_pods)).is_empty());
    }

    #[test]
    fn an_immediate_claim_ignores_a_selected_node() {
        let v = phase(
            pv("v").class("fast").node_affinity_hostname("node-b").build(),
            "Available",
        );
        let mut c = with_uid(pvc("ns", "c").class("fast").build(), "u1");
        c.annotations_mut()
            .insert(ANN_SELECTED_NODE.into(), "node-a".into());
        let out = sync_claim(
            &c,
            &cache(std::slice::from_ref(&v), std::slice::from_ref(&c)),
            &with(&no_pods),
        );
        assert!(
            out.contains(&Action::Bind {
                pv: "v".into(),
                claim: "ns/c".into()
            }),
            "{out:?}"
        );
    }

    #[test]
    fn a_delayed_claim_names_the_pods_waiting_to_be_scheduled() {
        let c = with_uid(pvc("ns", "c").class("wffc").build(), "u1");
        let one = |_: &str| {
            vec![
                PodUse {
                    name: "web-0".into(),
                    scheduled: false,
                },
                PodUse {
                    name: "done".into(),
                    scheduled: true,
                },
            ]
        };
        let out = sync_claim(&c, &cache(&[], std::slice::from_ref(&c)), &with(&one));
        assert!(
            events(&out).contains(&(
                false,
                "WaitForPodScheduled",
                "waiting for pod web-0 to be scheduled".into()
            )),
            "{out:?}"
        );
        let two = |_: &str| {
            ["a", "b"]
                .iter()
                .map(|n| PodUse {
                    name: n.to_string(),
                    scheduled: false,
                })
                .collect()
        };
        let out = sync_claim(&c, &cache(&[], std::slice::from_ref(&c)), &with(&two));
        assert!(
            events(&out).contains(&(
                false,
                "WaitForPodScheduled",
                "waiting for pods a,b to be scheduled".into()
            )),
            "{out:?}"
        );
        // The scheduler is about to update the claim (PreBind): no condition write races it.
        assert!(
            !out.iter().any(|a| matches!(a, Action::ClaimCondition { .. })),
            "{out:?}"
        );
        let out = sync_claim(&c, &cache(&[], std::slice::from_ref(&c)), &with(&no_pods));
        assert!(
            events(&out).iter().any(|(_, r, _)| *r == "WaitForFirstConsumer"),
            "{out:?}"
        );
        // Nor while no consumer is seen yet: a claim and its pod created together (one apply, a
        // StatefulSet) look like this until the pod arrives, and the scheduler's PreBind follows.
        assert!(
            !out.iter().any(|a| matches!(a, Action::ClaimCondition { .. })),
            "{out:?}"
        );
    }

    #[test]
    fn a_selected_node_the_class_cannot_serve_is_given_back_to_the_scheduler() {
        for node in ["node-b", "no-such-node"] {
            let mut c = with_uid(pvc("ns", "c").class("zoned").build(), "u1");
            c.annotations_mut().insert(ANN_SELECTED_NODE.into(), node.into());
            let out = sync_claim(&c, &cache(&[], std::slice::from_ref(&c)), &with(&no_pods));
            assert!(
                !out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
                "{node}: {out:?}"
            );
            assert!(
                events(&out)
                    .iter()
                    .any(|(w, r, n)| *w && *r == "ProvisioningFailed" && n.contains(node)),
                "{node}: {out:?}"
            );
            let (t, _, removed, _) = annotate(&out).expect("selected-node removed");
            assert_eq!(t, &Target::Claim("ns/c".into()));
            assert_eq!(removed, &vec![ANN_SELECTED_NODE.to_string()]);
        }
        let mut ok = with_uid(pvc("ns", "c").class("zoned").build(), "u1");
        ok.annotations_mut()
            .insert(ANN_SELECTED_NODE.into(), "node-a".into());
        let out = sync_claim(&ok, &cache(&[], std::slice::from_ref(&ok)), &with(&no_pods));
        assert!(
            out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
            "{out:?}"
        );
    }

    #[test]
    fn a_controller_bound_claim_whose_volume_went_to_another_claim_is_left_alone() {
        let v = phase(pv("v").claim_ref("ns", "other", "uid-other").build(), "Bound");
        let other = with_uid(pvc("ns", "other").volume_name("v").build(), "uid-other");
        let mut c = with_uid(
            pvc("ns", "c")
                .volume_name("v")
                .annotation(ANN_BOUND_BY_CONTROLLER, "yes")
                .build(),
            "u1",
        );
        c.status = Some(k8s_openapi::api::core::v1::PersistentVolumeClaimStatus {
            phase: Some("Bound".into()),
            ..Default::default()
        });
        let world = cache(std::slice::from_ref(&v), &[other, c.clone()]);
        let out = sync_claim(&c, &world, &with(&no_pods));
        assert!(
            !out.iter().any(|a| matches!(a, Action::ClaimPhase { .. })),
            "the claim is not reset: {out:?}"
        );
        assert!(
            events(&out).iter().any(|(w, r, _)| *w && *r == "FailedBinding"),
            "{out:?}"
        );
        assert!(
            out.iter().any(|a| matches!(a, Action::RetryLater { .. })),
            "{out:?}"
        );
        // Without the controller's annotation it is the user's request: Pending, as before.
        let mut user = c.clone();
        user.annotations_mut().remove(ANN_BOUND_BY_CONTROLLER);
        let out = sync_claim(&user, &world, &with(&no_pods));
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::ClaimPhase { phase: "Pending", .. })),
            "{out:?}"
        );
    }

    #[test]
    fn a_recycle_volume_waits_while_pods_still_use_its_claim() {
        let v = phase(
            pv("r")
                .reclaim("Recycle")
                .claim_ref("ns", "gone", "uid-gone")
                .build(),
            "Released",
        );
        let used = |claim: &str| {
            assert_eq!(claim, "ns/gone");
            vec![PodUse {
                name: "writer".into(),
                scheduled: true,
            }]
        };
        let out = sync_volume(&v, &cache(std::slice::from_ref(&v), &[]), &with(&used));
        assert_eq!(
            events(&out),
            vec![(
                false,
                "VolumeFailedRecycle",
                "Volume is used by pods: ns/writer".to_string()
            )]
        );
        assert!(
            !out.iter().any(|a| matches!(a, Action::VolumePhase { .. })),
            "stays Released: {out:?}"
        );
        // Nobody uses it: refused for good.
        let out = sync_volume(&v, &cache(std::slice::from_ref(&v), &[]), &with(&no_pods));
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::VolumePhase { phase: "Failed", .. })),
            "{out:?}"
        );
        assert!(
            events(&out)
                .iter()
                .any(|(w, r, _)| *w && *r == "VolumeFailedRecycle")
        );
    }
}

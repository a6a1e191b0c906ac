//! The data-safety decisions of the built-in driver, as pure functions: only volumes this
//! provisioner made are deleted, never an image another PV names, a failed image creation ends
//! deletable, and multi-node writer modes are refused.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use stowage_testkit::builders::{pv, pvc, storage_class};

use crate::core::{self, Action, Cache, DELETE_REFUSED, Env};
use crate::pv::*;
use crate::results::failure_backoff;

fn loop_class(name: &str) -> Option<Arc<StorageClass>> {
    (name == "loop").then(|| Arc::new(storage_class("loop", LOOP_DRIVER).build()))
}

fn env() -> Env<'static> {
    super::env_with(&loop_class)
}

fn cache(pvs: &[&PersistentVolume], claims: &[&PersistentVolumeClaim]) -> Cache {
    let mut c = Cache::default();
    for p in pvs {
        c.put_pv(Arc::new((*p).clone()));
    }
    for cl in claims {
        c.put_claim(Arc::new((*cl).clone()));
    }
    c
}

fn phase(mut v: PersistentVolume, p: &str) -> PersistentVolume {
    v.status.get_or_insert_with(Default::default).phase = Some(p.into());
    v
}

fn deleting(mut v: PersistentVolume) -> PersistentVolume {
    v.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    v
}

fn with_finalizer(mut v: PersistentVolume) -> PersistentVolume {
    v.metadata.finalizers = Some(vec![FINALIZER_LOOP_DELETER.into()]);
    v
}

/// A Delete-policy loop volume bound to claim app/gone (which no longer exists), Released.
fn released(name: &str, handle: &str, ours: bool) -> PersistentVolume {
    let mut b = pv(name)
        .reclaim("Delete")
        .driver(LOOP_DRIVER, handle)
        .claim_ref("app", "gone", "uid-gone");
    if ours {
        b = b.annotation(ANN_PROVISIONED_BY, LOOP_DRIVER);
    }
    phase(with_finalizer(b.build()), "Released")
}

fn refusal(actions: &[Action]) -> Option<String> {
    actions.iter().find_map(|a| match a {
        Action::Event(e) if e.reason == DELETE_REFUSED && e.warning => Some(e.note.clone()),
        _ => None,
    })
}

fn deletes(actions: &[Action]) -> bool {
    actions
        .iter()
        .any(|a| matches!(a, Action::DeleteLoopVolume { .. }))
}

#[test]
fn a_hand_made_delete_volume_is_never_deleted_and_loses_the_finalizer() {
    let v = released("precious", "precious", false);
    let out = core::sync_volume(&v, &cache(&[&v], &[]), &env());
    assert!(!deletes(&out), "{out:?}");
    let note = refusal(&out).expect("a Warning says why");
    assert!(note.contains("not provisioned by loop.stowage.dev"), "{note}");
    assert!(out.contains(&Action::SetDeleterFinalizer {
        pv: "precious".into(),
        present: false
    }));
    assert!(
        !out.iter().any(|a| matches!(a, Action::VolumePhase { .. })),
        "it stays Released"
    );
    // The provisioned-by annotation naming another provisioner is not ours either.
    let mut other = v.clone();
    other
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANN_PROVISIONED_BY.into(), "example.com/other".into());
    assert!(!deletes(&core::sync_volume(
        &other,
        &cache(&[&other], &[]),
        &env()
    )));
}

#[test]
fn the_deleter_finalizer_is_only_wanted_on_our_deletable_volumes() {
    let hand = pv("h").reclaim("Delete").build();
    assert!(!core::deleter_wanted(&hand));
    let ours = pv("o")
        .reclaim("Delete")
        .annotation(ANN_PROVISIONED_BY, LOOP_DRIVER)
        .build();
    assert!(core::deleter_wanted(&ours));
    let retain = pv("r").annotation(ANN_PROVISIONED_BY, LOOP_DRIVER).build();
    assert!(!core::deleter_wanted(&retain));
    let bad = pv("b")
        .reclaim("Delete")
        .driver(LOOP_DRIVER, "../etc")
        .annotation(ANN_PROVISIONED_BY, LOOP_DRIVER)
        .build();
    assert!(!core::deleter_wanted(&bad));
    // An admin deleting a hand-made volume that an older version gave the finalizer: dropped.
    let stuck = deleting(with_finalizer(pv("old").reclaim("Delete").build()));
    let out = core::sync_volume(&stuck, &cache(&[&stuck], &[]), &env());
    assert!(out.contains(&Action::SetDeleterFinalizer {
        pv: "old".into(),
        present: false
    }));
    assert!(!deletes(&out));
}

#[test]
fn an_image_another_volume_names_is_kept() {
    let a = released("a", "shared", true);
    let b = phase(pv("b").driver(LOOP_DRIVER, "shared").build(), "Available");
    let out = core::sync_volume(&a, &cache(&[&a, &b], &[]), &env());
    assert!(!deletes(&out), "{out:?}");
    assert!(refusal(&out).expect("a Warning says why").contains("b"));
    // Once b is gone, a's image is deleted.
    let out = core::sync_volume(&a, &cache(&[&a], &[]), &env());
    assert!(deletes(&out), "{out:?}");
    let c = cache(&[&a, &b], &[]);
    assert_eq!(c.sharing_handle(&a), vec!["b".to_string()]);
    let mut c = c;
    c.remove_pv("b");
    assert!(c.sharing_handle(&a).is_empty());
    assert!(c.handles.get("shared").is_some_and(|s| s.len() == 1));
}

#[test]
fn an_unclaimed_volume_of_ours_deleted_by_an_admin_is_reclaimed() {
    let v = deleting(with_finalizer(
        pv("free")
            .reclaim("Delete")
            .annotation(ANN_PROVISIONED_BY, LOOP_DRIVER)
            .build(),
    ));
    let out = core::sync_volume(&v, &cache(&[&v], &[]), &env());
    assert!(deletes(&out), "{out:?}");
}

fn provisioned(claim: &PersistentVolumeClaim) -> PersistentVolume {
    let class = storage_class("loop", LOOP_DRIVER).build();
    crate::loopdev::provisioned_pv(claim, &class, None).expect("claim with a request")
}

fn claim_1ei() -> PersistentVolumeClaim {
    let mut c = pvc("app", "huge").request("1Ei").class("loop").build();
    c.metadata.uid = Some("u-1".into());
    c
}

#[test]
fn a_permanent_image_failure_stops_retrying_and_is_reported_on_the_claim() {
    let c = claim_1ei();
    let pending = phase(provisioned(&c), "Pending");
    let out = core::sync_volume(&pending, &cache(&[&pending], &[&c]), &env());
    assert!(out.contains(&Action::CreateLoopImage { pv: "pvc-u-1".into() }));
    let mut failed = phase(provisioned(&c), "Failed");
    failed.status.as_mut().unwrap().message = Some("cannot create the image: File too large".into());
    let cache1 = cache(&[&failed], &[&c]);
    let out = core::sync_volume(&failed, &cache1, &env());
    assert!(
        !out.iter().any(|a| matches!(a, Action::CreateLoopImage { .. })),
        "{out:?}"
    );
    let out = core::sync_claim(&c, &cache1, &env());
    assert!(!out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })));
    let note = out
        .iter()
        .find_map(|a| match a {
            Action::Event(e) if e.reason == "ProvisioningFailed" => Some(e.note.clone()),
            _ => None,
        })
        .expect("ProvisioningFailed");
    assert!(note.contains("File too large"), "{note}");
    assert!(out.iter().any(|a| matches!(
        a,
        Action::ClaimCondition {
            reason: "ProvisioningFailed",
            ..
        }
    )));
    // The claim is deleted: the failed volume is released, then deleted.
    let out = core::sync_volume(&failed, &cache(&[&failed], &[]), &env());
    assert!(deletes(&out), "{out:?}");
    // The volume is deleted by an admin while its claim waits: deleted (it never held data).
    let gone = deleting(failed.clone());
    assert!(deletes(&core::sync_volume(
        &gone,
        &cache(&[&gone], &[&c]),
        &env()
    )));
}

#[test]
fn multi_node_writer_modes_are_refused_for_the_loop_driver() {
    for (modes, refused) in [
        (&["ReadWriteMany"][..], true),
        (&["ReadWriteOnce", "ReadWriteMany"][..], true),
        (&["ReadWriteOnce"][..], false),
        (&["ReadWriteOncePod"][..], false),
        (&["ReadOnlyMany"][..], false),
    ] {
        let mut c = pvc("app", "c").access_modes(modes).class("loop").build();
        c.metadata.uid = Some("u".into());
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &env());
        let provisions = out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. }));
        assert_eq!(provisions, !refused, "{modes:?}: {out:?}");
        if refused {
            let note = out
                .iter()
                .find_map(|a| match a {
                    Action::Event(e) if e.reason == "ProvisioningFailed" && e.warning => Some(e.note.clone()),
                    _ => None,
                })
                .expect("ProvisioningFailed");
            assert!(note.contains("two kernels"), "{note}");
        }
    }
}

#[test]
fn selectors_and_data_sources_are_refused_for_the_loop_driver() {
    use k8s_openapi::api::core::v1::TypedLocalObjectReference;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    let base = || {
        let mut c = pvc("app", "c")
            .access_modes(&["ReadWriteOnce"])
            .class("loop")
            .build();
        c.metadata.uid = Some("u".into());
        c
    };
    let mut selector = base();
    selector.spec.as_mut().unwrap().selector = Some(LabelSelector::default());
    let mut clone = base();
    clone.spec.as_mut().unwrap().data_source = Some(TypedLocalObjectReference {
        kind: "PersistentVolumeClaim".into(),
        name: "src".into(),
        api_group: None,
    });
    let mut restore = base();
    restore.spec.as_mut().unwrap().data_source_ref = Some(k8s_openapi::api::core::v1::TypedObjectReference {
        kind: "VolumeSnapshot".into(),
        name: "snap".into(),
        api_group: Some("snapshot.storage.k8s.io".into()),
        namespace: None,
    });
    for (c, says) in [
        (selector, "selector"),
        (clone, "\"src\""),
        (restore, "VolumeSnapshot \"snap\""),
    ] {
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &env());
        assert!(
            !out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
            "{out:?}"
        );
        let note = out
            .iter()
            .find_map(|a| match a {
                Action::Event(e) if e.reason == "ProvisioningFailed" && e.warning => Some(e.note.clone()),
                _ => None,
            })
            .expect("ProvisioningFailed");
        assert!(note.contains(says), "{note}");
    }
    let plain = base();
    let out = core::sync_claim(&plain, &cache(&[], &[&plain]), &env());
    assert!(
        out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
        "{out:?}"
    );
}

#[test]
fn failure_retries_back_off_exponentially_to_five_minutes() {
    assert_eq!(failure_backoff(0), Duration::from_secs(1));
    assert_eq!(failure_backoff(1), Duration::from_secs(2));
    let steps: Vec<Duration> = (0..40).map(failure_backoff).collect();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(*steps.last().unwrap(), Duration::from_secs(300));
}

/// The deleter waits while VolumeAttachments name the volume; the note names their nodes in a
/// stable order (sorted, de-duplicated, at most ten), so every retry sends the same text and
/// the Warning is recorded once.
#[test]
fn a_volume_named_by_attachments_waits_with_a_stable_note() {
    assert_eq!(core::still_attached("pv", &[]), None);
    let a = core::still_attached("pv", &["n2".into(), "n1".into(), "n2".into()]).unwrap();
    let b = core::still_attached("pv", &["n1".into(), "n2".into()]).unwrap();
    assert_eq!(a, b);
    assert!(a.contains("n1, n2") && a.contains("still attached"), "{a}");
    let many: Vec<String> = (0..25).map(|i| format!("node-{i:02}")).collect();
    let n = core::still_attached("pv", &many).unwrap();
    assert!(
        n.contains("node-09") && !n.contains("node-10") && n.contains("and 15 more"),
        "{n}"
    );
}

/// Which provisioned volumes get their file system at creation: Filesystem, ReadOnlyMany only,
/// ext4 (or unset); everything else is left to the first writer's stage, as before.
#[test]
fn only_read_only_many_filesystem_volumes_are_formatted_at_creation() {
    let class = storage_class("loop", LOOP_DRIVER).build();
    let made = |modes: &[&str], block: bool, fs: Option<&str>| {
        let mut b = pvc("app", "c").access_modes(modes).class("loop");
        if block {
            b = b.block();
        }
        let mut c = b.build();
        c.metadata.uid = Some("u".into());
        let mut v = crate::loopdev::provisioned_pv(&c, &class, None).unwrap();
        v.spec.as_mut().unwrap().csi.as_mut().unwrap().fs_type = fs.map(Into::into);
        crate::loopdev::formatted_at_creation(&v)
    };
    assert!(made(&["ReadOnlyMany"], false, Some("ext4")));
    assert!(made(&["ReadOnlyMany"], false, None));
    assert!(!made(&["ReadOnlyMany"], true, Some("ext4")), "Block");
    assert!(
        !made(&["ReadOnlyMany"], false, Some("xfs")),
        "not the driver's file system"
    );
    assert!(
        !made(&["ReadOnlyMany", "ReadWriteOnce"], false, Some("ext4")),
        "a writer formats it"
    );
    assert!(!made(&["ReadWriteOnce"], false, Some("ext4")));
    assert!(!made(&["ReadWriteOncePod"], false, Some("ext4")));
}

/// Local mode: each node has its own image store. A volume is made only for the node
/// the scheduler chose and is pinned to it; the binder never touches its image (the node's agent
/// makes and deletes it), and a volume whose node is gone is kept, with a Warning.
mod local {
    use super::*;
    use crate::core::{Action, VOLUME_NODE_GONE};

    fn wffc_class(name: &str) -> Option<Arc<StorageClass>> {
        match name {
            "loop" => loop_class(name),
            "later" => Some(Arc::new(
                storage_class("later", LOOP_DRIVER)
                    .wait_for_first_consumer()
                    .build(),
            )),
            _ => None,
        }
    }

    fn node_a(name: &str) -> Option<BTreeMap<String, String>> {
        (name == "node-a").then(BTreeMap::new)
    }

    fn local_env() -> Env<'static> {
        Env {
            class: &wffc_class,
            node_labels: &node_a,
            local: true,
            ..env()
        }
    }

    fn chosen(class: &str, node: &str) -> PersistentVolumeClaim {
        let mut c = pvc("app", "data").request("1Gi").class(class).build();
        c.metadata.uid = Some("u-7".into());
        c.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(ANN_SELECTED_NODE.into(), node.into());
        c
    }

    fn on_node(v: PersistentVolume, node: &str) -> PersistentVolume {
        let class = storage_class("later", LOOP_DRIVER).build();
        let claim = chosen("later", node);
        let pinned = crate::loopdev::provisioned_pv(&claim, &class, Some(node)).unwrap();
        let mut v = v;
        v.spec.as_mut().unwrap().node_affinity = pinned.spec.unwrap().node_affinity;
        v
    }

    #[test]
    fn a_volume_is_provisioned_for_the_selected_node_and_pinned_to_it() {
        let c = chosen("later", "node-a");
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &local_env());
        assert!(
            out.contains(&Action::ProvisionLoop {
                claim: "app/data".into(),
                class: "later".into(),
                node: Some("node-a".into()),
            }),
            "{out:?}"
        );
        let class = storage_class("later", LOOP_DRIVER).build();
        let v = crate::loopdev::provisioned_pv(&c, &class, Some("node-a")).unwrap();
        assert_eq!(loop_node(&v), Some("node-a"));
        assert!(
            has_ann(&v, ANN_IMAGE_PENDING),
            "bound only once the node made the image"
        );
        // Shared mode: no node affinity of the driver's.
        let shared = crate::loopdev::provisioned_pv(&c, &class, None).unwrap();
        assert_eq!(loop_node(&shared), None);
        assert!(shared.spec.unwrap().node_affinity.is_none());
    }

    fn nodes_ab(name: &str) -> Option<BTreeMap<String, String>> {
        matches!(name, "node-a" | "node-b").then(BTreeMap::new)
    }

    /// node-b has the most room, node-z the most of all but is no Node.
    fn rooms(class: &str) -> Vec<(String, u128)> {
        assert_eq!(class, "loop");
        vec![
            ("node-a".into(), 2 << 30),
            ("node-b".into(), 5 << 30),
            ("node-z".into(), 50 << 30),
        ]
    }

    fn failed_note(out: &[Action]) -> String {
        out.iter()
            .find_map(|a| match a {
                Action::Event(e) if e.reason == "ProvisioningFailed" && e.warning => Some(e.note.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no ProvisioningFailed: {out:?}"))
    }

    #[test]
    fn an_immediate_class_is_provisioned_on_the_node_with_the_most_room_that_fits() {
        let claim = |size: &str| {
            let mut c = pvc("app", "now").request(size).class("loop").build();
            c.metadata.uid = Some("u-8".into());
            c
        };
        let roomy = Env {
            node_labels: &nodes_ab,
            room: &rooms,
            ..local_env()
        };
        let c = claim("1Gi");
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &roomy);
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::ProvisionLoop { node: Some(n), .. } if n == "node-b")),
            "the most room among existing nodes: {out:?}"
        );
        // Only node-b can hold 3Gi; nothing holds 6Gi, and the Warning says what there is.
        let c = claim("3Gi");
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &roomy);
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::ProvisionLoop { node: Some(n), .. } if n == "node-b"))
        );
        let c = claim("6Gi");
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &roomy);
        assert!(
            !out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
            "{out:?}"
        );
        let note = failed_note(&out);
        assert!(
            note.contains("no node's image store has room") && note.contains("node-b"),
            "{note}"
        );
        // No agent publishes: the Warning says to look at the agents, or to wait for a consumer.
        let c = claim("1Gi");
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &local_env());
        assert!(
            !out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
            "{out:?}"
        );
        assert!(failed_note(&out).contains("WaitForFirstConsumer"));
        // The agents publish, but not yet for this class (made moments ago): a Normal Event that
        // it waits for them, no Warning, nothing provisioned yet.
        let unseen = Env {
            node_labels: &nodes_ab,
            publishing: &|| true,
            ..local_env()
        };
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &unseen);
        assert!(
            !out.iter().any(|a| matches!(a, Action::ProvisionLoop { .. })),
            "{out:?}"
        );
        assert!(
            out.iter().any(|a| matches!(a, Action::Event(e)
                if e.reason == core::WAITING_FOR_CAPACITY && !e.warning
                    && e.note.contains("not yet published room"))),
            "{out:?}"
        );
        assert!(
            !out.iter().any(|a| matches!(a, Action::Event(e) if e.warning)),
            "no Warning while the agents catch up: {out:?}"
        );
        // The same claim in shared mode is provisioned at once, pinned nowhere.
        let out = core::sync_claim(&c, &cache(&[], &[&c]), &env());
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::ProvisionLoop { node: None, .. }))
        );
    }

    #[test]
    fn the_binder_never_makes_a_node_local_image_and_reports_a_vanished_node() {
        let c = chosen("later", "node-a");
        let class = storage_class("later", LOOP_DRIVER).build();
        let pending = phase(
            crate::loopdev::provisioned_pv(&c, &class, Some("node-a")).unwrap(),
            "Pending",
        );
        let out = core::sync_volume(&pending, &cache(&[&pending], &[&c]), &local_env());
        assert!(
            !out.iter().any(|a| matches!(a, Action::CreateLoopImage { .. })),
            "the node's agent makes it: {out:?}"
        );
        assert!(!out.iter().any(|a| matches!(a, Action::Event(_))), "{out:?}");
        let elsewhere = phase(
            crate::loopdev::provisioned_pv(&c, &class, Some("node-z")).unwrap(),
            "Pending",
        );
        let out = core::sync_volume(&elsewhere, &cache(&[&elsewhere], &[&c]), &local_env());
        assert!(
            out.iter().any(
                |a| matches!(a, Action::Event(e) if e.reason == VOLUME_NODE_GONE && e.note.contains("node-z"))
            ),
            "{out:?}"
        );
    }

    #[test]
    fn deletion_is_asked_of_the_node_once_and_never_done_without_it() {
        let v = on_node(released("v1", "pvc-v1", true), "node-a");
        let out = core::sync_volume(&v, &cache(&[&v], &[]), &local_env());
        assert!(deletes(&out), "{out:?}");
        // Asked already: the node's agent is on it.
        let mut asked = v.clone();
        asked
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(ANN_DELETE_IMAGE.into(), "true".into());
        let out = core::sync_volume(&asked, &cache(&[&asked], &[]), &local_env());
        assert!(!deletes(&out), "{out:?}");
        // Its node is gone: the volume and its file stay, and the Warning names the node.
        let gone = on_node(released("v2", "pvc-v2", true), "node-z");
        let out = core::sync_volume(&gone, &cache(&[&gone], &[]), &local_env());
        assert!(!deletes(&out), "{out:?}");
        assert!(
            out.iter()
                .any(|a| matches!(a, Action::Event(e) if e.reason == VOLUME_NODE_GONE && e.warning && e.note.contains("node-z"))),
            "{out:?}"
        );
    }
}

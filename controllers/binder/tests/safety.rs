//! Data safety of the built-in driver against the real apiserver with a real image directory
//! (issue 15): only volumes this provisioner made are deleted, never an image another PV names,
//! a failed image creation ends deletable, multi-node writer modes are refused, and a failing
//! claim does not flood the cluster with Event objects.

mod common;

use std::time::Duration;

use common::{Harness, WAIT};
use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use stowage_testkit::builders::{pv, pvc, storage_class};
use stowage_testkit::eventually;

const DELETER: &str = "loop.stowage.dev/deleter";
use stowage_loopdriver::image::MARKER;

fn has_deleter(v: &PersistentVolume) -> bool {
    v.finalizers().iter().any(|f| f == DELETER)
}

/// Waits until the binder is done with a deleted volume: gone, or waiting only on finalizers
/// that are not the binder's (pv-protection is not under test here).
async fn released_by_binder(h: &Harness, name: &str) {
    eventually(WAIT, || async {
        match h.pvs().get_opt(name).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(v) if v.metadata.deletion_timestamp.is_some() && !has_deleter(&v) => Ok(()),
            Some(v) => Err(format!(
                "volume {name} phase {:?}, deleting {}, finalizers {:?}",
                v.status.and_then(|s| s.phase),
                v.metadata.deletion_timestamp.is_some(),
                v.metadata.finalizers
            )),
        }
    })
    .await;
}

/// Waits for the claim's Pending condition with `reason`, returning its message.
async fn pending_because(h: &Harness, ns: &str, name: &str, reason: &str) -> String {
    let c = h
        .claim_until(ns, name, &format!("Pending with a {reason} condition"), |c| {
            let st = c.status.as_ref();
            st.and_then(|s| s.phase.as_deref()) == Some("Pending")
                && st.and_then(|s| s.conditions.as_ref()).is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "stowage.dev/Pending" && c.reason.as_deref() == Some(reason))
                })
        })
        .await;
    c.status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "stowage.dev/Pending")
        .and_then(|c| c.message)
        .unwrap_or_default()
}

/// What the image directory holds besides the store's marker.
fn images_left(h: &Harness) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(h.images.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.ends_with(MARKER))
        .collect()
}

fn counter(h: &Harness, name: &str, label: (&str, &str)) -> f64 {
    let m = stowage_testkit::scrape::parse(&h.metrics_text()).unwrap();
    m.samples
        .get(name)
        .into_iter()
        .flatten()
        .filter(|(l, _)| l.get(label.0).map(String::as_str) == Some(label.1))
        .map(|(_, v)| v)
        .sum()
}

/// The first scenario: a hand-made volume of the built-in driver with policy Delete,
/// bound and then released, must not lose the admin's image.
#[tokio::test]
async fn a_hand_made_delete_volume_keeps_its_image_when_released() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let img = h.images.path().join("precious.img");
    std::fs::write(&img, b"precious").unwrap();
    h.create_pv(
        pv("precious")
            .class("own")
            .reclaim("Delete")
            .driver("loop.stowage.dev", "precious")
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "c").class("own").build()).await;
    h.claim_phase("app", "c", "Bound").await;
    let v = h.volume_phase("precious", "Bound").await;
    assert!(
        !has_deleter(&v),
        "never held by the deleter: {:?}",
        v.finalizers()
    );
    h.delete_claim("app", "c").await;
    let note = h.event("precious", "VolumeDeleteRefused").await;
    assert!(note.contains("not provisioned by loop.stowage.dev"), "{note}");
    let v = h.volume_phase("precious", "Released").await;
    assert!(!has_deleter(&v));
    assert_eq!(
        std::fs::read(&img).unwrap(),
        b"precious",
        "the admin's image survives"
    );
    eventually(WAIT, || async {
        let n = counter(
            &h,
            "stowage_binder_warning_events_total",
            ("reason", "VolumeDeleteRefused"),
        );
        if n >= 1.0 {
            Ok(())
        } else {
            Err(format!("warning counter {n}"))
        }
    })
    .await;
}

/// Volumes made by older versions carry the deleter finalizer on hand-made volumes; an admin
/// deleting such an unclaimed volume must see it go, and its image stay.
#[tokio::test]
async fn an_unclaimed_hand_made_delete_volume_deleted_by_an_admin_goes_and_keeps_its_image() {
    let h = Harness::start().await;
    let img = h.images.path().join("manual.img");
    std::fs::write(&img, b"keep me").unwrap();
    let mut v = pv("manual")
        .class("own")
        .reclaim("Delete")
        .driver("loop.stowage.dev", "manual")
        .build();
    v.metadata.finalizers = Some(vec![DELETER.into()]);
    h.create_pv(v).await;
    h.volume_phase("manual", "Available").await;
    h.pvs().delete("manual", &Default::default()).await.unwrap();
    released_by_binder(&h, "manual").await;
    assert_eq!(std::fs::read(&img).unwrap(), b"keep me");
    // What is left is pv-protection's (its controller is not running here).
    h.delete_volume("manual").await;
    eventually(WAIT, || async {
        match h.pvs().get_opt("manual").await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(v) => Err(format!("still there: {:?}", v.metadata.finalizers)),
        }
    })
    .await;
    assert_eq!(std::fs::read(&img).unwrap(), b"keep me");
}

/// Two PVs naming one image: releasing one never deletes the image the other still names; once
/// the other is gone, the provisioned one is deleted with its image.
#[tokio::test]
async fn two_volumes_sharing_a_handle_never_delete_each_others_image() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let img = h.images.path().join("shared.img");
    std::fs::write(&img, b"both").unwrap();
    h.create_pv(
        pv("made")
            .class("a")
            .reclaim("Delete")
            .driver("loop.stowage.dev", "shared")
            .annotation("pv.kubernetes.io/provisioned-by", "loop.stowage.dev")
            .build(),
    )
    .await;
    h.create_pv(pv("copy").class("b").driver("loop.stowage.dev", "shared").build())
        .await;
    h.create_pvc(pvc("app", "c").class("a").build()).await;
    h.claim_phase("app", "c", "Bound").await;
    let v = h.volume_phase("made", "Bound").await;
    assert!(
        has_deleter(&v),
        "a volume this provisioner made is held by its deleter"
    );
    h.delete_claim("app", "c").await;
    let note = h.event("made", "VolumeDeleteRefused").await;
    assert!(note.contains("copy"), "names the other volume: {note}");
    h.volume_phase("made", "Released").await;
    assert_eq!(
        std::fs::read(&img).unwrap(),
        b"both",
        "the other volume's data survives"
    );

    h.delete_volume("copy").await;
    released_by_binder(&h, "made").await;
    assert!(!img.exists(), "deleted with the last volume that names it");
}

/// The second scenario: a 1Ei claim. Image creation fails for good (EFBIG on the image
/// dir's file system): the claim says why, no empty image is left, the failure is reported as
/// one Event object however often the claim is synced, and deleting the claim cleans up.
#[tokio::test]
async fn a_claim_too_big_for_the_image_dir_fails_for_good_and_cleans_up() {
    let h = Harness::start_with(|c| c.resync = Duration::from_secs(1)).await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let c = h
        .create_pvc(pvc("app", "huge").request("1Ei").class("loop").build())
        .await;
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    let msg = pending_because(&h, "app", "huge", "ProvisioningFailed").await;
    assert!(msg.contains("File too large"), "{msg}");
    let v = h.volume_phase(&name, "Failed").await;
    assert!(
        v.annotations().contains_key("loop.stowage.dev/image-pending"),
        "never bindable"
    );
    let leftovers = images_left(&h);
    assert!(leftovers.is_empty(), "no empty image left behind: {leftovers:?}");

    // Many syncs later (1 s resync), still one ProvisioningFailed Event object for the claim.
    let syncs = counter(&h, "stowage_binder_reconcile_total", ("kind", "claim"));
    eventually(WAIT, || async {
        let now = counter(&h, "stowage_binder_reconcile_total", ("kind", "claim"));
        if now >= syncs + 5.0 {
            Ok(())
        } else {
            Err(format!("{now} claim syncs, want {}", syncs + 5.0))
        }
    })
    .await;
    let events = h.events(Some("app"), "huge", "ProvisioningFailed").await;
    assert_eq!(
        events.len(),
        1,
        "one Event object, not one per retry: {events:#?}"
    );
    // A repeat would not be a second object: the sender folds it into the first one's series.
    assert_eq!(events[0].series, None, "the event was repeated");

    h.delete_claim("app", "huge").await;
    released_by_binder(&h, &name).await;
    let leftovers = images_left(&h);
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Deleting the failed volume itself (not the claim) must not hang on the deleter finalizer.
#[tokio::test]
async fn a_failed_provisioned_volume_deleted_by_an_admin_does_not_hang() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let c = h
        .create_pvc(pvc("app", "huge").request("1Ei").class("loop").build())
        .await;
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    let first = h.volume_phase(&name, "Failed").await;
    h.pvs().delete(&name, &Default::default()).await.unwrap();
    // Gone, or re-created for the claim that still asks for it (a new object, same name).
    eventually(WAIT, || async {
        match h.pvs().get_opt(&name).await.map_err(|e| e.to_string())? {
            Some(v) if v.metadata.uid == first.metadata.uid && has_deleter(&v) => {
                Err(format!("still held: {:?}", v.metadata.finalizers))
            }
            _ => Ok(()),
        }
    })
    .await;
    let leftovers = images_left(&h);
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// The third scenario: a ReadWriteMany loop claim must not be provisioned.
#[tokio::test]
async fn a_read_write_many_loop_claim_is_refused() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    h.create_pvc(
        pvc("app", "shared")
            .access_modes(&["ReadWriteMany"])
            .class("loop")
            .build(),
    )
    .await;
    let msg = pending_because(&h, "app", "shared", "ProvisioningFailed").await;
    assert!(
        msg.contains("ReadWriteMany") && msg.contains("two kernels"),
        "{msg}"
    );
    let note = h.event("shared", "ProvisioningFailed").await;
    assert_eq!(note, msg);
    assert!(
        h.pvs().list(&Default::default()).await.unwrap().items.is_empty(),
        "no volume created"
    );
    assert!(images_left(&h).is_empty(), "no image created");

    // ReadOnlyMany is provisioned (the node side makes it read-only).
    h.create_pvc(
        pvc("app", "ro")
            .access_modes(&["ReadOnlyMany"])
            .request("16Mi")
            .class("loop")
            .build(),
    )
    .await;
    h.claim_phase("app", "ro", "Bound").await;
}

/// The event storm on a volume with an unsafe handle: refused once, not once per retry.
#[tokio::test]
async fn a_volume_with_an_unsafe_handle_is_refused_with_one_event() {
    let h = Harness::start_with(|c| c.resync = Duration::from_secs(1)).await;
    h.namespace("app").await;
    h.create_pv(
        pv("unsafe")
            .class("u")
            .reclaim("Delete")
            .driver("loop.stowage.dev", "../outside")
            .annotation("pv.kubernetes.io/provisioned-by", "loop.stowage.dev")
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "c").class("u").build()).await;
    h.claim_phase("app", "c", "Bound").await;
    let v = h.volume_phase("unsafe", "Bound").await;
    assert!(
        !has_deleter(&v),
        "nothing of ours to delete, so nothing to hold it"
    );
    h.delete_claim("app", "c").await;
    let v = h.volume_phase("unsafe", "Failed").await;
    let msg = v.status.and_then(|s| s.message).unwrap_or_default();
    assert!(msg.contains("not a plain file name"), "{msg}");
    let syncs = counter(&h, "stowage_binder_reconcile_total", ("kind", "volume"));
    eventually(WAIT, || async {
        let now = counter(&h, "stowage_binder_reconcile_total", ("kind", "volume"));
        if now >= syncs + 5.0 {
            Ok(())
        } else {
            Err(format!("{now} volume syncs, want {}", syncs + 5.0))
        }
    })
    .await;
    let refused = h.events(None, "unsafe", "VolumeDeleteRefused").await;
    assert_eq!(refused.len(), 1, "{refused:#?}");
    assert_eq!(refused[0].series, None, "the event was repeated");
    assert!(h.events(None, "unsafe", "VolumeFailedDelete").await.is_empty());
}

/// A missing image directory (as before a mount appears) is retried with backoff, not given up:
/// once the directory exists with the store's marker the claim binds.
#[tokio::test]
async fn a_missing_image_dir_is_retried_until_it_appears() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("later");
    let cfg_dir = images.clone();
    let h = Harness::start_with(move |c| c.image_dir = cfg_dir).await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let c = h
        .create_pvc(pvc("app", "wait").request("16Mi").class("loop").build())
        .await;
    let note = h.event("wait", "ImageStoreNotReady").await;
    assert!(note.contains("retrying"), "{note}");
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    let v = h.pvs().get(&name).await.unwrap();
    assert_ne!(
        v.status.and_then(|s| s.phase).as_deref(),
        Some("Failed"),
        "a transient failure is not final"
    );
    std::fs::create_dir(&images).unwrap();
    stowage_loopdriver::ImageStore::new(&images).init().unwrap();
    h.claim_phase("app", "wait", "Bound").await;
    assert_eq!(
        std::fs::metadata(images.join(format!("{name}.img")))
            .unwrap()
            .len(),
        16 << 20
    );
}

/// A transient failure backs off (1 s doubling) even when the resync comes every second: the
/// resync leaves a backing-off key alone, and the warning is sent once, not once per attempt.
#[tokio::test]
async fn a_failing_image_creation_backs_off_across_resyncs() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("never");
    let h = Harness::start_with(move |c| {
        c.image_dir = missing;
        c.resync = Duration::from_secs(1);
    })
    .await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    h.create_pvc(pvc("app", "slow").request("16Mi").class("loop").build())
        .await;
    h.event("slow", "ImageStoreNotReady").await;
    // Twelve resyncs of the claim (one a second) later...
    let syncs = counter(&h, "stowage_binder_reconcile_total", ("kind", "claim"));
    eventually(WAIT, || async {
        let now = counter(&h, "stowage_binder_reconcile_total", ("kind", "claim"));
        if now >= syncs + 12.0 {
            Ok(())
        } else {
            Err(format!("{now} claim syncs, want {}", syncs + 12.0))
        }
    })
    .await;
    // ...the image was tried at 0, 1, 3, 7 (and maybe 15) s: a handful, not one per resync.
    let attempts = counter(
        &h,
        "stowage_binder_image_store_refusals_total",
        ("operation", "create"),
    );
    assert!((2.0..=7.0).contains(&attempts), "{attempts} attempts");
    let events = h.events(Some("app"), "slow", "ImageStoreNotReady").await;
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0].series, None, "the event was repeated");
}

/// A clone or restore claim (a data source) and a claim with a selector are refused by the
/// built-in provisioner with the reason, as external-provisioner refuses what its driver cannot
/// do: no PV and no image, rather than an empty volume where a copy was expected.
#[tokio::test]
async fn data_source_and_selector_claims_are_refused_not_given_empty_volumes() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let mut clone = pvc("app", "clone").request("16Mi").class("loop").build();
    clone.spec.as_mut().unwrap().data_source = Some(k8s_openapi::api::core::v1::TypedLocalObjectReference {
        api_group: None,
        kind: "PersistentVolumeClaim".into(),
        name: "origin".into(),
    });
    let clone = h.create_pvc(clone).await;
    let picky = h
        .create_pvc(
            pvc("app", "picky")
                .request("16Mi")
                .class("loop")
                .selector("tier", "gold")
                .build(),
        )
        .await;
    let msg = pending_because(&h, "app", "clone", "ProvisioningFailed").await;
    assert!(msg.contains("origin"), "{msg}");
    let msg = pending_because(&h, "app", "picky", "ProvisioningFailed").await;
    assert!(msg.contains("selector"), "{msg}");
    for c in [clone, picky] {
        let name = format!("pvc-{}", c.metadata.uid.unwrap());
        assert!(
            h.pvs().get_opt(&name).await.unwrap().is_none(),
            "{name} was provisioned"
        );
    }
    let images = images_left(&h);
    assert!(images.is_empty(), "{images:?}");
}

/// A provisioned volume whose claim is deleted while a VolumeAttachment still names it (a node
/// may still have its image behind a loop device, mounted): the deleter waits, with a Warning
/// `VolumeStillAttached` on the volume, and touches nothing; once the attachment is gone the
/// retry deletes the image and the volume (external-provisioner: "still attached to node").
#[tokio::test]
async fn a_volume_still_attached_is_deleted_only_after_its_attachment_goes() {
    use k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec};
    use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};

    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let claim = h
        .create_pvc(pvc("app", "data").request("16Mi").class("loop").build())
        .await;
    h.claim_phase("app", "data", "Bound").await;
    let name = format!("pvc-{}", claim.uid().unwrap());
    let img = h.images.path().join(format!("{name}.img"));
    std::fs::write(&img, b"still mounted on node-a").unwrap();

    // The attachment, held by its attacher's finalizer as a real one is until the node detaches.
    let vas: kube::Api<VolumeAttachment> = kube::Api::all(h.client.clone());
    vas.create(
        &PostParams::default(),
        &VolumeAttachment {
            metadata: ObjectMeta {
                name: Some("csi-attached".into()),
                finalizers: Some(vec!["external-attacher/loop-stowage-dev".into()]),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: "loop.stowage.dev".into(),
                node_name: "node-a".into(),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some(name.clone()),
                    ..Default::default()
                },
            },
            status: None,
        },
    )
    .await
    .unwrap();
    // Being deleted still names the volume: the node has not let go yet.
    vas.delete("csi-attached", &Default::default()).await.unwrap();

    h.delete_claim("app", "data").await;
    let note = h.event(&name, "VolumeStillAttached").await;
    assert!(note.contains("node-a"), "{note}");
    let warned = |h: &Harness| {
        counter(
            h,
            "stowage_binder_warning_events_total",
            ("reason", "VolumeStillAttached"),
        )
    };
    // Retried with backoff: several attempts, one Warning (the same text every time).
    eventually(WAIT, || async {
        let tries = counter(
            &h,
            "stowage_binder_reconcile_errors_total",
            ("error", "invalid_state"),
        );
        if tries >= 3.0 {
            Ok(())
        } else {
            Err(format!("{tries} failed attempts"))
        }
    })
    .await;
    assert_eq!(warned(&h), 1.0);
    assert_eq!(
        std::fs::read(&img).unwrap(),
        b"still mounted on node-a",
        "the image is untouched while attached"
    );
    let v = h.pvs().get(&name).await.expect("the volume stays");
    assert_eq!(
        v.status.and_then(|s| s.phase).as_deref(),
        Some("Released"),
        "waiting is not a failure"
    );
    assert!(has_deleter(&h.pvs().get(&name).await.unwrap()));

    // The node lets go: the attacher drops its finalizer, the attachment goes, the deletion ends.
    vas.patch(
        "csi-attached",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    released_by_binder(&h, &name).await;
    assert!(!img.exists(), "deleted once no attachment names the volume");
}

fn gauge(h: &Harness, name: &str) -> f64 {
    h.metric_sum(name)
}

/// A store without its marker (a shared file system not mounted on the leader's node leaves an
/// empty directory): no image is made there; the claim gets a Warning `ImageStoreNotReady`, the
/// refusal is counted and the readiness gauge is 0, and the volume is not Failed. Once the marker
/// appears (the store is mounted), provisioning goes on.
#[tokio::test]
async fn an_unmarked_store_gets_no_image_until_its_marker_appears() {
    let h = Harness::start().await;
    let marker = h.images.path().join(MARKER);
    let saved = std::fs::read(&marker).unwrap();
    std::fs::remove_file(&marker).unwrap();
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let c = h
        .create_pvc(pvc("app", "early").request("16Mi").class("loop").build())
        .await;
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    let note = h.event("early", "ImageStoreNotReady").await;
    assert!(
        note.contains(MARKER) && note.contains("init-image-store"),
        "{note}"
    );
    assert!(images_left(&h).is_empty(), "no image on an unmarked store");
    assert!(
        counter(
            &h,
            "stowage_binder_image_store_refusals_total",
            ("operation", "create")
        ) >= 1.0
    );
    assert_eq!(gauge(&h, "stowage_binder_image_store_ready"), 0.0);
    let v = h.pvs().get(&name).await.unwrap();
    assert_ne!(v.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Failed"));
    assert!(
        v.annotations().contains_key("loop.stowage.dev/image-pending"),
        "not bindable yet"
    );

    std::fs::write(&marker, saved).unwrap();
    h.claim_phase("app", "early", "Bound").await;
    assert_eq!(
        std::fs::metadata(h.images.path().join(format!("{name}.img")))
            .unwrap()
            .len(),
        16 << 20
    );
    eventually(WAIT, || async {
        match gauge(&h, "stowage_binder_image_store_ready") {
            1.0 => Ok(()),
            g => Err(format!("image store ready gauge {g}")),
        }
    })
    .await;
}

/// The store goes away under a bound Delete-policy volume (unmounted: the directory is empty,
/// the image "missing"): deleting the claim neither deletes the volume nor marks it Failed, and
/// no `VolumeImageMissing` is reported; the volume waits with a Warning `ImageStoreNotReady`.
/// Once the store is back, the deleter removes the image and the volume.
#[tokio::test]
async fn a_volume_whose_store_is_unmounted_is_not_deleted_as_missing() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let c = h
        .create_pvc(pvc("app", "data").request("16Mi").class("loop").build())
        .await;
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    h.claim_phase("app", "data", "Bound").await;
    // "Unmount": everything the directory held moves away, as if it were on another disk.
    let elsewhere = tempfile::tempdir().unwrap();
    let moved: Vec<_> = std::fs::read_dir(h.images.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    for f in &moved {
        std::fs::rename(h.images.path().join(f), elsewhere.path().join(f)).unwrap();
    }
    let refusals = counter(
        &h,
        "stowage_binder_image_store_refusals_total",
        ("operation", "delete"),
    );
    h.delete_claim("app", "data").await;
    let note = h.event(&name, "ImageStoreNotReady").await;
    assert!(note.contains(MARKER), "{note}");
    eventually(WAIT, || async {
        let now = counter(
            &h,
            "stowage_binder_image_store_refusals_total",
            ("operation", "delete"),
        );
        if now > refusals {
            Ok(())
        } else {
            Err(format!("{now} delete refusals"))
        }
    })
    .await;
    let v = h.pvs().get(&name).await.unwrap();
    assert!(
        v.metadata.deletion_timestamp.is_none(),
        "the volume is not deleted"
    );
    assert!(has_deleter(&v), "the deleter still holds it");
    assert_ne!(v.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Failed"));
    assert!(h.events(None, &name, "VolumeImageMissing").await.is_empty());
    assert!(h.events(None, &name, "VolumeFailedDelete").await.is_empty());
    assert_eq!(gauge(&h, "stowage_binder_image_store_ready"), 0.0);

    // "Mounted" again: the retry deletes the image and then the volume.
    for f in &moved {
        std::fs::rename(elsewhere.path().join(f), h.images.path().join(f)).unwrap();
    }
    released_by_binder(&h, &name).await;
    assert!(images_left(&h).is_empty(), "{:?}", images_left(&h));
}

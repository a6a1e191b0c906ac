//! The binder against the real apiserver: static and pre-bound binding, reclaim, lost claims and
//! races, end to end (provisioning and classes are in provisioning.rs).

mod common;

use std::collections::BTreeMap;

use common::{Harness, WAIT};
use kube::ResourceExt;
use stowage_testkit::builders::{pv, pvc};
use stowage_testkit::eventually;

fn anns(o: &impl ResourceExt) -> BTreeMap<String, String> {
    o.annotations().clone()
}

#[tokio::test]
async fn static_binding_picks_the_smallest_sufficient_volume() {
    let h = Harness::start().await;
    h.namespace("app").await;
    for (name, size) in [("pv-1g", "1Gi"), ("pv-5g", "5Gi"), ("pv-10g", "10Gi")] {
        h.create_pv(pv(name).capacity(size).class("manual").build()).await;
    }
    h.create_pvc(pvc("app", "data").request("3Gi").class("manual").build())
        .await;
    let claim = h.claim_phase("app", "data", "Bound").await;
    assert_eq!(claim.spec.as_ref().unwrap().volume_name.as_deref(), Some("pv-5g"));
    assert_eq!(
        anns(&claim)
            .get("pv.kubernetes.io/bind-completed")
            .map(String::as_str),
        Some("yes")
    );
    assert_eq!(
        anns(&claim)
            .get("pv.kubernetes.io/bound-by-controller")
            .map(String::as_str),
        Some("yes")
    );
    let st = claim.status.unwrap();
    assert_eq!(st.capacity.unwrap()["storage"].0, "5Gi");
    assert_eq!(st.access_modes.unwrap(), vec!["ReadWriteOnce".to_string()]);
    let v = h.volume_phase("pv-5g", "Bound").await;
    let r = v.spec.as_ref().unwrap().claim_ref.as_ref().unwrap();
    assert_eq!(r.uid, claim.metadata.uid);
    assert_eq!(
        anns(&v)
            .get("pv.kubernetes.io/bound-by-controller")
            .map(String::as_str),
        Some("yes")
    );
    h.volume_phase("pv-1g", "Available").await;
    h.volume_phase("pv-10g", "Available").await;
}

#[tokio::test]
async fn user_prebound_volume_and_claim_are_honoured() {
    let h = Harness::start().await;
    h.namespace("app").await;
    // A smaller free volume exists, but the user pre-bound a bigger one to the claim by name.
    h.create_pv(pv("small").capacity("1Gi").build()).await;
    h.create_pv(pv("mine").capacity("2Gi").claim_ref("app", "a", "").build())
        .await;
    h.create_pvc(pvc("app", "a").request("1Gi").class("").build())
        .await;
    let a = h.claim_phase("app", "a", "Bound").await;
    let conds = a
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    assert!(
        conds.iter().all(|c| c.type_ != "stowage.dev/Pending"),
        "a bound claim has no Pending condition: {conds:?}"
    );
    assert_eq!(a.spec.unwrap().volume_name.as_deref(), Some("mine"));
    let v = h.volume_phase("mine", "Bound").await;
    assert!(
        !anns(&v).contains_key("pv.kubernetes.io/bound-by-controller"),
        "a user pre-binding stays the user's"
    );

    // A claim asking for a volume by name binds to it even though selectors would not be checked.
    h.create_pvc(
        pvc("app", "b")
            .request("1Gi")
            .class("")
            .volume_name("small")
            .build(),
    )
    .await;
    let b = h.claim_phase("app", "b", "Bound").await;
    assert_eq!(b.spec.unwrap().volume_name.as_deref(), Some("small"));
}

#[tokio::test]
async fn requested_volume_that_does_not_fit_is_a_volume_mismatch() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pv(pv("tiny").capacity("1Gi").build()).await;
    h.create_pvc(
        pvc("app", "big")
            .request("5Gi")
            .class("")
            .volume_name("tiny")
            .build(),
    )
    .await;
    let note = h.event("big", "VolumeMismatch").await;
    assert!(note.contains("too small"), "{note}");
    h.claim_phase("app", "big", "Pending").await;
    h.volume_phase("tiny", "Available").await;
}

#[tokio::test]
async fn released_volumes_follow_their_reclaim_policy() {
    let h = Harness::start().await;
    h.namespace("app").await;
    // Retain: the volume stays Released with its data.
    let img = h.images.path().join("keep.img");
    std::fs::write(&img, b"precious").unwrap();
    h.create_pv(
        pv("keep")
            .class("retain")
            .driver("loop.stowage.dev", "keep")
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "r").class("retain").build()).await;
    h.claim_phase("app", "r", "Bound").await;
    h.delete_claim("app", "r").await;
    h.volume_phase("keep", "Released").await;
    assert_eq!(
        std::fs::read(&img).unwrap(),
        b"precious",
        "Retain never loses data"
    );

    // Delete, built-in driver, a volume it provisioned: image removed, then the volume object.
    // (Hand-made volumes keep their image: tests/safety.rs.)
    let img = h.images.path().join("gone.img");
    std::fs::write(&img, b"scratch").unwrap();
    h.create_pv(
        pv("gone")
            .class("del")
            .reclaim("Delete")
            .driver("loop.stowage.dev", "gone")
            .annotation("pv.kubernetes.io/provisioned-by", "loop.stowage.dev")
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "d").class("del").build()).await;
    h.claim_phase("app", "d", "Bound").await;
    let v = h.volume_phase("gone", "Bound").await;
    assert!(
        v.finalizers().iter().any(|f| f == "loop.stowage.dev/deleter"),
        "{:?}",
        v.finalizers()
    );
    h.delete_claim("app", "d").await;
    // pv-protection is not under test here: once the binder has removed the image and its own
    // finalizer, the object waits only on the admission-added protection finalizer.
    eventually(WAIT, || async {
        let v = h.pvs().get_opt("gone").await.map_err(|e| e.to_string())?;
        match v {
            Some(v)
                if v.metadata.deletion_timestamp.is_some()
                    && !v.finalizers().iter().any(|f| f == "loop.stowage.dev/deleter") =>
            {
                Ok(())
            }
            None => Ok(()),
            Some(v) => Err(format!(
                "volume still {:?} with finalizers {:?}",
                v.status.and_then(|s| s.phase),
                v.metadata.finalizers
            )),
        }
    })
    .await;
    assert!(!img.exists(), "the image of a Delete volume is removed");

    // Recycle is not supported: Failed, with an event saying so.
    h.create_pv(pv("recycle").class("rec").reclaim("Recycle").build())
        .await;
    h.create_pvc(pvc("app", "c").class("rec").build()).await;
    h.claim_phase("app", "c", "Bound").await;
    h.delete_claim("app", "c").await;
    let v = h.volume_phase("recycle", "Failed").await;
    assert!(
        v.status
            .unwrap()
            .message
            .unwrap_or_default()
            .contains("not supported")
    );
    h.event("recycle", "VolumeFailedRecycle").await;
}

#[tokio::test]
async fn a_delete_volume_whose_image_is_already_gone_still_finishes() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pv(
        pv("noimg")
            .class("del")
            .reclaim("Delete")
            .driver("loop.stowage.dev", "noimg")
            .annotation("pv.kubernetes.io/provisioned-by", "loop.stowage.dev")
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "d").class("del").build()).await;
    h.claim_phase("app", "d", "Bound").await;
    h.delete_claim("app", "d").await;
    h.event("noimg", "VolumeImageMissing").await;
    // And it finishes: the binder drops its deleter finalizer and deletes the object (which then
    // waits only on the admission-added pv-protection finalizer, not under test here).
    eventually(WAIT, || async {
        let v = h.pvs().get_opt("noimg").await.map_err(|e| e.to_string())?;
        match v {
            None => Ok(()),
            Some(v)
                if v.metadata.deletion_timestamp.is_some()
                    && !v.finalizers().iter().any(|f| f == "loop.stowage.dev/deleter") =>
            {
                Ok(())
            }
            Some(v) => Err(format!(
                "volume not deleted: deletionTimestamp {:?}, finalizers {:?}",
                v.metadata.deletion_timestamp, v.metadata.finalizers
            )),
        }
    })
    .await;
}

#[tokio::test]
async fn a_bound_claim_whose_volume_vanished_is_lost() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pv(pv("v").build()).await;
    h.create_pvc(pvc("app", "c").class("").build()).await;
    h.claim_phase("app", "c", "Bound").await;
    h.delete_volume("v").await;
    let lost = h.claim_phase("app", "c", "Lost").await;
    // Upstream's updateClaimStatus without a volume: nothing describes a volume any more.
    let st = lost.status.unwrap();
    assert_eq!(st.capacity, None, "capacity of a lost claim");
    assert_eq!(st.access_modes, None, "access modes of a lost claim");
    let note = h.event("c", "ClaimLost").await;
    assert!(note.contains("lost"), "{note}");
}

#[tokio::test]
async fn a_volume_bound_into_a_missing_namespace_is_released() {
    let h = Harness::start().await;
    h.create_pv(
        pv("orphan")
            .claim_ref("ghost-ns", "gone", "0f0f0f0f-0000-0000-0000-000000000000")
            .build(),
    )
    .await;
    h.volume_phase("orphan", "Released").await;
}

#[tokio::test]
async fn a_recreated_claim_with_the_same_name_does_not_inherit_the_old_binding() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pv(pv("v1").build()).await;
    h.create_pvc(pvc("app", "same").class("").build()).await;
    let old = h.claim_phase("app", "same", "Bound").await;
    h.delete_claim("app", "same").await;
    h.volume_phase("v1", "Released").await;
    h.create_pv(pv("v2").build()).await;
    h.create_pvc(pvc("app", "same").class("").build()).await;
    let new = h.claim_phase("app", "same", "Bound").await;
    assert_ne!(new.metadata.uid, old.metadata.uid);
    assert_eq!(
        new.spec.unwrap().volume_name.as_deref(),
        Some("v2"),
        "the Released volume keeps the old UID"
    );
    h.volume_phase("v1", "Released").await;
}

#[tokio::test]
async fn fifty_claims_race_for_ten_volumes() {
    let h = Harness::start().await;
    h.namespace("race").await;
    let mut creates = Vec::new();
    for i in 0..10 {
        creates.push(tokio::spawn({
            let api = h.pvs();
            async move {
                api.create(&Default::default(), &pv(&format!("v{i}")).class("r").build())
                    .await
                    .map(|_| ())
            }
        }));
    }
    for i in 0..50 {
        creates.push(tokio::spawn({
            let api = h.pvcs("race");
            async move {
                api.create(
                    &Default::default(),
                    &pvc("race", &format!("c{i}")).class("r").build(),
                )
                .await
                .map(|_| ())
            }
        }));
    }
    for c in creates {
        c.await.unwrap().unwrap();
    }
    let bound = eventually(WAIT, || async {
        let list = h
            .pvcs("race")
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        let bound: Vec<_> = list
            .items
            .into_iter()
            .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .collect();
        if bound.len() == 10 {
            Ok(bound)
        } else {
            Err(format!("{} bound", bound.len()))
        }
    })
    .await;
    // Nothing more may bind, and every binding is one-to-one, even after the binder has looked
    // at every claim again (a full resync syncs all 50 claims and 10 volumes once more) and what
    // it decided has landed: a sync is counted once its writes have started, and the in-flight
    // gauge is back at 0 only when every started write has finished.
    h.until_counter_grows_by("stowage_binder_reconcile_total", 60.0)
        .await;
    h.until_gauge_is("stowage_binder_in_flight", 0.0).await;
    let claims = h.pvcs("race").list(&Default::default()).await.unwrap().items;
    let pending = claims
        .iter()
        .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending"))
        .count();
    assert_eq!(pending, 40);
    let mut vols: Vec<String> = bound
        .iter()
        .map(|c| c.spec.as_ref().unwrap().volume_name.clone().unwrap())
        .collect();
    vols.sort();
    vols.dedup();
    assert_eq!(vols.len(), 10, "no volume holds two claims");
    for v in h.pvs().list(&Default::default()).await.unwrap().items {
        let r = v.spec.unwrap().claim_ref.unwrap();
        let c = claims
            .iter()
            .find(|c| c.metadata.uid == r.uid)
            .expect("claimRef names a real claim");
        assert_eq!(
            c.spec.as_ref().unwrap().volume_name.as_deref(),
            v.metadata.name.as_deref()
        );
    }
    let m = stowage_testkit::scrape::parse(&h.metrics_text()).unwrap();
    assert!(m.sum("stowage_binder_reconcile_total") > 0.0);
    assert_eq!(
        m.samples["stowage_persistentvolumeclaims"]
            .iter()
            .find(|(l, _)| l["phase"] == "Bound")
            .map(|x| x.1),
        Some(10.0)
    );
}

#[tokio::test]
async fn a_released_hand_made_delete_volume_nobody_can_delete_is_failed() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let mut hp = pv("hp").reclaim("Delete").claim_ref("app", "gone", "").build();
    let spec = hp.spec.as_mut().unwrap();
    spec.csi = None;
    spec.host_path = Some(k8s_openapi::api::core::v1::HostPathVolumeSource {
        path: "/srv/data".into(),
        type_: None,
    });
    h.create_pv(hp).await;
    h.create_pvc(pvc("app", "gone").class("").build()).await;
    h.claim_phase("app", "gone", "Bound").await;
    h.delete_claim("app", "gone").await;
    let v = h.volume_phase("hp", "Failed").await;
    let note = h.event("hp", "VolumeFailedDelete").await;
    assert!(note.contains("no deletable volume plugin matched"), "{note}");
    assert!(
        v.status
            .unwrap()
            .message
            .unwrap_or_default()
            .contains("no deletable volume plugin"),
        "the reason is on the volume too"
    );
}

/// A released Recycle volume waits while a pod still uses its old claim (upstream: Released,
/// Normal VolumeFailedRecycle naming the pods), and is refused (Failed) once the pod is gone:
/// the pod's deletion wakes the volume, with no resync in between (15 s here).
#[tokio::test]
async fn a_recycle_volume_waits_for_the_pods_of_its_old_claim_then_fails() {
    use k8s_openapi::api::core::v1::Pod;
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pv(pv("rc").reclaim("Recycle").class("manual").build())
        .await;
    h.create_pvc(pvc("app", "old").class("manual").build()).await;
    h.claim_phase("app", "old", "Bound").await;
    let pods: kube::Api<Pod> = kube::Api::namespaced(h.client.clone(), "app");
    pods.create(
        &Default::default(),
        &stowage_testkit::builders::pod("app", "user")
            .claim("data", "old")
            .build(),
    )
    .await
    .unwrap();
    h.delete_claim("app", "old").await;
    let note = h.event("rc", "VolumeFailedRecycle").await;
    assert!(note.contains("app/user"), "{note}");
    let v = h.volume_phase("rc", "Released").await;
    assert_eq!(v.status.unwrap().phase.as_deref(), Some("Released"));

    pods.delete("user", &kube::api::DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let v = h.volume_phase("rc", "Failed").await;
    let msg = v.status.unwrap().message.unwrap_or_default();
    assert!(msg.contains("recycling is not supported"), "{msg}");
}

/// The binder stores PVs and claims in the read model's form and writes them back whole (PUT): every field the
/// objects carried, including ones it never reads, must come back from the apiserver unchanged.
#[tokio::test]
async fn a_bind_writes_back_every_field_the_objects_carried() {
    use k8s_openapi::api::core::v1::SecretReference;
    use std::collections::BTreeMap;
    let h = Harness::start().await;
    h.namespace("app").await;
    let mut v = pv("pv-rich")
        .capacity("2Gi")
        .class("manual")
        .node_affinity_hostname("node-a")
        .build();
    v.metadata.labels = Some(BTreeMap::from([("tier".into(), "gold".into())]));
    v.metadata.annotations = Some(BTreeMap::from([("example.com/owner".into(), "team-a".into())]));
    let spec = v.spec.as_mut().unwrap();
    spec.mount_options = Some(vec!["noatime".into(), "nodiscard".into()]);
    spec.volume_mode = Some("Filesystem".into());
    let csi = spec.csi.as_mut().unwrap();
    csi.fs_type = Some("ext4".into());
    csi.read_only = Some(false);
    csi.volume_attributes = Some(BTreeMap::from([("size".into(), "2Gi".into())]));
    csi.node_publish_secret_ref = Some(SecretReference {
        name: Some("loop-secret".into()),
        namespace: Some("app".into()),
    });
    let created_pv = h.create_pv(v).await;
    let mut c = pvc("app", "rich").request("1Gi").class("manual").build();
    c.metadata.labels = Some(BTreeMap::from([("app".into(), "db".into())]));
    c.metadata.annotations = Some(BTreeMap::from([("example.com/backup".into(), "daily".into())]));
    let created_claim = h.create_pvc(c).await;

    let claim = h.claim_phase("app", "rich", "Bound").await;
    let bound = h.volume_phase("pv-rich", "Bound").await;
    // The volume: everything but the claimRef the bind set is as created.
    let mut want = created_pv.spec.clone().unwrap();
    let mut got = bound.spec.clone().unwrap();
    assert!(got.claim_ref.take().is_some());
    want.claim_ref = None;
    assert_eq!(got, want);
    assert_eq!(bound.labels(), created_pv.labels());
    assert_eq!(
        anns(&bound).get("example.com/owner").map(String::as_str),
        Some("team-a")
    );
    // The claim: everything but the volumeName the bind set is as created.
    let mut want = created_claim.spec.clone().unwrap();
    let mut got = claim.spec.clone().unwrap();
    assert_eq!(got.volume_name.take().as_deref(), Some("pv-rich"));
    want.volume_name = None;
    assert_eq!(got, want);
    assert_eq!(claim.labels(), created_claim.labels());
    assert_eq!(
        anns(&claim).get("example.com/backup").map(String::as_str),
        Some("daily")
    );
}

/// The informers and the PUTs decode objects without managed fields: what they hold is
/// exactly what the apiserver serves, less that one field, which the apiserver does send.
#[tokio::test]
async fn stores_and_writes_hold_what_the_apiserver_serves_less_managed_fields() {
    use kube::runtime::reflector::ObjectRef;
    use stowage_common::api::writes::Writes;
    let mut h = stowage_testkit::InProcess::new().await;
    h.namespace("app").await;
    let cluster = h.cluster().await;
    h.create_pv(pv("pv-lean").capacity("1Gi").class("manual").build())
        .await;
    h.create_pvc(pvc("app", "lean").request("1Gi").class("manual").build())
        .await;
    let served = h.pvs().get("pv-lean").await.unwrap();
    assert!(
        served.metadata.managed_fields.is_some(),
        "the apiserver sends managed fields"
    );

    let counter = prometheus::IntCounterVec::new(prometheus::Opts::new("writes", "test"), &["op"]).unwrap();
    let writes = Writes::new(h.client.clone(), counter);
    let mut next = served.clone();
    next.labels_mut().insert("lean".into(), "yes".into());
    let written = writes.replace_pv(&next, "test").await.unwrap();
    let mut want = h.pvs().get("pv-lean").await.unwrap();
    assert!(want.metadata.managed_fields.take().is_some());
    assert_eq!(written, want, "a PUT's answer");

    let claim = h.pvcs("app").get("lean").await.unwrap();
    let mut status = claim.clone();
    status.status.get_or_insert_default().phase = Some("Pending".into());
    let written = writes.replace_claim_status(&status, "test").await.unwrap();
    let mut want_claim = h.pvcs("app").get("lean").await.unwrap();
    assert!(want_claim.metadata.managed_fields.take().is_some());
    assert_eq!(written, want_claim, "a status PUT's answer");

    // The stores catch up with the writes; then they hold the same objects.
    let stored_pv = stored_at(cluster.pvs.store(), ObjectRef::new("pv-lean"), &want).await;
    assert_eq!(stored_pv, want, "the PV informer's object");
    let key = ObjectRef::new("lean").within("app");
    let stored_claim = stored_at(cluster.pvcs.store(), key, &want_claim).await;
    assert_eq!(stored_claim, want_claim, "the claim informer's object");
}

/// The object a store holds once it has caught up with `want`'s resourceVersion, decoded.
async fn stored_at<K: stowage_common::store::Storable>(
    store: &kube::runtime::reflector::Store<stowage_common::store::Stored<K>>,
    key: kube::runtime::reflector::ObjectRef<stowage_common::store::Stored<K>>,
    want: &K,
) -> K {
    let rv = &want.metadata().resource_version;
    eventually(WAIT, || async {
        match store.get(&key) {
            Some(o) if &o.meta().resource_version == rv => Ok(o.decode()),
            other => Err(format!(
                "stored: {:?}",
                other.map(|o| o.meta().resource_version.clone())
            )),
        }
    })
    .await
}

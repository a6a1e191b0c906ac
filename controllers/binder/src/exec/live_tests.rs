use super::*;
use stowage_testkit::InProcess;
use stowage_testkit::builders::pv as pv_builder;

/// The cache may lag a PV just created that names the same image; the live list before the
/// removal catches it (against the real apiserver, with a real image dir).
#[tokio::test]
async fn a_sharer_the_cache_has_not_seen_yet_keeps_the_image() {
    let h = InProcess::new().await;
    let made = h
        .create_pv(
            pv_builder("made")
                .reclaim("Delete")
                .driver(LOOP_DRIVER, "shared")
                .annotation(ANN_PROVISIONED_BY, LOOP_DRIVER)
                .build(),
        )
        .await;
    h.create_pv(pv_builder("late").driver(LOOP_DRIVER, "shared").build())
        .await;
    let img = h.images.path().join("shared.img");
    std::fs::write(&img, b"data").unwrap();
    let executor = Executor {
        pvs: Api::all(h.client.clone()),
        events: Events::new(h.client.clone(), "test"),
        client: h.client.clone(),
        metrics: Metrics::new(&h.registry),
        images: loopdev::ImageStore::new(h.images.path()),
        store_mode: Default::default(),
        live: Default::default(),
        store_check: Default::default(),
        timestamps: Default::default(),
    };
    // The cache knows only the volume being deleted.
    let mut cache = Cache::default();
    cache.put_pv(Arc::new(made));
    let action = Action::DeleteLoopVolume { pv: "made".into() };
    let snap = Snapshot::of(&cache, std::slice::from_ref(&action));
    let mut done = Outcome::empty(None);
    executor.apply(&action, &snap, &mut done).await.unwrap();
    assert_eq!(std::fs::read(&img).unwrap(), b"data", "the image is kept");
    let refused = done
        .events
        .iter()
        .find(|(e, _)| e.reason == core::DELETE_REFUSED)
        .map(|(e, _)| e.note.clone())
        .expect("VolumeDeleteRefused");
    assert!(refused.contains("late"), "{refused}");
    assert!(h.pvs().get_opt("made").await.unwrap().is_some(), "not deleted");

    // Once the other volume is gone, the same deletion goes through.
    h.pvs().delete("late", &Default::default()).await.unwrap();
    let patch = serde_json::json!({"metadata": {"finalizers": null}});
    h.pvs()
        .patch(
            "late",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let mut done = Outcome::empty(None);
    executor.apply(&action, &snap, &mut done).await.unwrap();
    assert!(!img.exists(), "deleted with the last volume naming it");
}

/// An executor writing to `h`'s apiserver and image directory.
fn executor(h: &InProcess) -> Executor {
    Executor {
        pvs: Api::all(h.client.clone()),
        events: Events::new(h.client.clone(), "test"),
        client: h.client.clone(),
        metrics: Metrics::new(&h.registry),
        images: loopdev::ImageStore::new(h.images.path()),
        store_mode: Default::default(),
        live: Default::default(),
        store_check: Default::default(),
        timestamps: Default::default(),
    }
}

/// A built-in, Delete-policy volume with its image, Released from claim `ns/c` (UID `uid`).
async fn released_volume(h: &InProcess, name: &str, uid: &str) -> (PersistentVolume, std::path::PathBuf) {
    let mut v = pv_builder(name)
        .reclaim("Delete")
        .driver(LOOP_DRIVER, name)
        .annotation(ANN_PROVISIONED_BY, LOOP_DRIVER)
        .claim_ref("ns", "c", uid)
        .build();
    v.metadata.finalizers = Some(vec![FINALIZER_LOOP_DELETER.into()]);
    let v = h.create_pv(v).await;
    let img = h.images.path().join(format!("{name}.img"));
    std::fs::write(&img, b"data").unwrap();
    (v, img)
}

/// The deletion decides on the live volume, not the cached one: an admin who switched the
/// policy to Retain after the cache saw Delete keeps the data. Without the live read, the
/// cached copy (still Delete) removes the image.
#[tokio::test]
async fn the_deletion_reads_the_volume_live_before_removing_its_image() {
    let h = InProcess::new().await;
    let (cached, img) = released_volume(&h, "retained", "uid-gone").await;
    let patch = serde_json::json!({"spec": {"persistentVolumeReclaimPolicy": "Retain"}});
    h.pvs()
        .patch(
            "retained",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let mut cache = Cache::default();
    cache.put_pv(Arc::new(cached));
    let action = Action::DeleteLoopVolume {
        pv: "retained".into(),
    };
    let snap = Snapshot::of(&cache, std::slice::from_ref(&action));
    let mut done = Outcome::empty(None);
    let applied = executor(&h).apply(&action, &snap, &mut done).await;
    assert_eq!(std::fs::read(&img).unwrap(), b"data", "the image is kept");
    applied.unwrap();
    assert!(
        h.pvs().get_opt("retained").await.unwrap().is_some(),
        "not deleted"
    );
}

/// The claim a Released volume names may exist after all (created a moment ago, not yet in the
/// cache): a live read of the claim stops the deletion with a stale-cache error, and the key is
/// retried. Without the read, the image is removed under a live claim.
#[tokio::test]
async fn the_deletion_reads_the_claim_live_before_removing_its_image() {
    let h = InProcess::new().await;
    h.namespace("ns").await;
    let claim = h
        .create_pvc(stowage_testkit::builders::pvc("ns", "c").build())
        .await;
    let uid = claim.metadata.uid.clone().unwrap();
    let (cached, img) = released_volume(&h, "claimed", &uid).await;
    // The cache has the volume, not the claim.
    let mut cache = Cache::default();
    cache.put_pv(Arc::new(cached));
    let action = Action::DeleteLoopVolume { pv: "claimed".into() };
    let snap = Snapshot::of(&cache, std::slice::from_ref(&action));
    let mut done = Outcome::empty(None);
    let exec = executor(&h);
    let err = exec
        .apply(&action, &snap, &mut done)
        .await
        .expect_err("the live claim stops the deletion");
    assert!(matches!(err, crate::error::Error::StaleCache(_)), "{err:?}");
    assert_eq!(std::fs::read(&img).unwrap(), b"data", "the image is kept");
    assert!(h.pvs().get_opt("claimed").await.unwrap().is_some(), "not deleted");

    // Once the claim is really gone, the same deletion goes through.
    h.pvcs("ns").delete("c", &Default::default()).await.unwrap();
    let patch = serde_json::json!({"metadata": {"finalizers": null}});
    h.pvcs("ns")
        .patch(
            "c",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .ok();
    stowage_testkit::eventually(std::time::Duration::from_secs(30), || async {
        match h.pvcs("ns").get_opt("c").await {
            Ok(None) => Ok(()),
            other => Err(format!("claim still there: {other:?}")),
        }
    })
    .await;
    let mut done = Outcome::empty(None);
    exec.apply(&action, &snap, &mut done).await.unwrap();
    assert!(!img.exists(), "deleted once no claim names it");
}

/// A deletion that keeps failing says so with the change to `Failed` (upstream's
/// updateVolumePhaseWithEvent), not with every retry: the phase is in the object, so a second
/// attempt — by this leader or a new one — adds no Warning. Still an error, so it is retried.
#[tokio::test]
async fn a_failing_image_removal_warns_once_with_the_change_to_failed() {
    let h = InProcess::new().await;
    let (cached, img) = released_volume(&h, "stuck", "uid-gone").await;
    // An image path that cannot be unlinked: a directory with something in it.
    std::fs::remove_file(&img).unwrap();
    std::fs::create_dir(&img).unwrap();
    std::fs::write(img.join("keep"), b"data").unwrap();
    let mut cache = Cache::default();
    cache.put_pv(Arc::new(cached));
    let action = Action::DeleteLoopVolume { pv: "stuck".into() };
    let snap = Snapshot::of(&cache, std::slice::from_ref(&action));
    let exec = executor(&h);
    let failed_delete = |done: &Outcome| {
        done.events
            .iter()
            .filter(|(e, _)| e.reason == "VolumeFailedDelete")
            .count()
    };

    let mut first = Outcome::empty(None);
    exec.apply(&action, &snap, &mut first)
        .await
        .expect_err("the image cannot be removed");
    assert_eq!(failed_delete(&first), 1, "{:?}", first.events);
    let live = h.pvs().get("stuck").await.unwrap();
    assert_eq!(pv_phase(&live), "Failed");

    let mut again = Outcome::empty(None);
    exec.apply(&action, &snap, &mut again)
        .await
        .expect_err("still cannot be removed");
    assert_eq!(failed_delete(&again), 0, "repeated: {:?}", again.events);
    assert_eq!(std::fs::read(img.join("keep")).unwrap(), b"data");
    assert!(h.pvs().get_opt("stuck").await.unwrap().is_some(), "not deleted");
}

/// The file system of a ReadOnlyMany image is made only on a blank image: a second run leaves
/// the ext4 it made (same UUID), and an image holding anything else is refused, never formatted.
#[tokio::test]
async fn a_read_only_many_image_is_formatted_only_when_blank() {
    let dir = tempfile::tempdir().unwrap();
    let uuid = |p: &std::path::Path| {
        let out = std::process::Command::new("blkid")
            .args(["-p", "-o", "value", "-s", "UUID"])
            .arg(p)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let img = dir.path().join("v.img");
    std::fs::File::create(&img).unwrap().set_len(16 << 20).unwrap();
    stowage_loopdriver::image::format_new_image(&img, "ext4")
        .await
        .unwrap();
    let first = uuid(&img);
    assert!(!first.is_empty(), "formatted");
    stowage_loopdriver::image::format_new_image(&img, "ext4")
        .await
        .unwrap();
    assert_eq!(uuid(&img), first, "an image that holds ext4 is left as it is");

    let swap = dir.path().join("swap.img");
    std::fs::File::create(&swap).unwrap().set_len(16 << 20).unwrap();
    assert!(
        std::process::Command::new("mkswap")
            .arg(&swap)
            .output()
            .unwrap()
            .status
            .success()
    );
    let e = stowage_loopdriver::image::format_new_image(&swap, "ext4")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("swap") && !e.permanent(), "{e}");
    let probe = stowage_loopdriver::sys::probe(swap.to_str().unwrap())
        .await
        .unwrap();
    assert_eq!(probe, stowage_loopdriver::sys::Probe::Found("swap".into()));
}

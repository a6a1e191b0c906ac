
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
        image_dir: h.images.path().to_path_buf(),
        live: Arc::default(),
    };
    // The cache knows only the volume being deleted.
    let mut cache = Cache::default();
    cache.put_pv(Arc::new(made));
    let action = Action::DeleteLoopVolume { pv: "made".into() };
    let snap = Snapshot::of(&cache, std::slice::from_ref(&action));
    let mut done = Outcome::empty(Key::Volume("made".into()), None);
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
    let mut done = Outcome::empty(Key::Volume("made".into()), None);
    executor.apply(&action, &snap, &mut done).await.unwrap();
    assert!(!img.exists(), "deleted with the last volume naming it");
}

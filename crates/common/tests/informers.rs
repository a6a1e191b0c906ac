//! The shared informers against the real apiserver: every watch lists before `ready` returns,
//! a change reaches both the store and each subscriber's feed (as the stored form the
//! controllers read), a deletion comes as `Deleted` with the object as last seen, and the
//! CSIStorageCapacity watch runs only when asked for.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use stowage_common::store::StoredVolume;
use stowage_common::store::informer::{Change, Feed};
use stowage_common::store::informers::Informers;
use stowage_testkit::ControlPlane;
use stowage_testkit::builders::pv;
use tokio::task::JoinSet;

/// The next change of `feed` for the volume `name` (others, and resyncs, are skipped).
async fn next_for(feed: &mut Feed<StoredVolume>, name: &str) -> Change<StoredVolume> {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let change = feed.next().await.expect("the watch is running");
            let about = match &change {
                Change::Applied(v) | Change::Deleted(v) => v.meta().name.as_deref() == Some(name),
                Change::Resynced => false,
            };
            if about {
                return change;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no change of {name} within 30 s"))
}

#[tokio::test(flavor = "multi_thread")]
async fn informers_list_then_feed_every_change_to_store_and_subscribers() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .expect("control plane");
    let client = cp.client().await;
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    // Made before the informers start: it must be in the store once `ready` returns.
    pvs.create(&PostParams::default(), &pv("before").build())
        .await
        .unwrap();

    let mut tasks = JoinSet::new();
    let registry = stowage_common::observe::metrics::Registry::new();
    let informers: Arc<Informers> = Informers::start(client.clone(), registry, &mut tasks);
    assert!(
        informers.capacities.is_none(),
        "no CSIStorageCapacity watch unless asked for"
    );
    informers.ready().await;
    assert!(
        informers.pvs.store().get(&ObjectRef::new("before")).is_some(),
        "ready returned before the initial list was in the store"
    );

    // Two subscribers see the same changes.
    let mut first = informers.pvs.feed();
    let mut second = informers.pvs.feed();
    pvs.create(&PostParams::default(), &pv("after").capacity("2Gi").build())
        .await
        .unwrap();
    for feed in [&mut first, &mut second] {
        let Change::Applied(v) = next_for(feed, "after").await else {
            panic!("a create must come as Applied");
        };
        // The stored form reads what the controllers read of a volume.
        let source = v.source().expect("the stored volume reads back");
        assert_eq!(
            source.csi.as_ref().map(|c| c.driver.as_str()),
            Some("loop.stowage.dev")
        );
    }
    assert!(informers.pvs.store().get(&ObjectRef::new("after")).is_some());

    // The apiserver's admission adds pv-protection's finalizer; no controller runs here to take
    // it off, so the test does.
    pvs.delete("after", &DeleteParams::default()).await.unwrap();
    let unguard = serde_json::json!({"metadata": {"finalizers": null}});
    pvs.patch("after", &PatchParams::default(), &Patch::Merge(&unguard))
        .await
        .unwrap();
    let gone = loop {
        match next_for(&mut first, "after").await {
            Change::Deleted(v) => break v,
            // The deletion mark and the finalizer's removal come as updates first.
            Change::Applied(v) => assert!(v.meta().deletion_timestamp.is_some()),
            Change::Resynced => {}
        }
    };
    assert_eq!(gone.meta().name.as_deref(), Some("after"));
    assert!(
        informers.pvs.store().get(&ObjectRef::new("after")).is_none(),
        "the store still holds a deleted volume"
    );

    // Asked for, the capacity watch runs and lists too.
    let mut more = JoinSet::new();
    let with = Informers::start_with(
        client,
        stowage_common::observe::metrics::Registry::new(),
        &mut more,
        true,
    );
    with.ready().await;
    assert!(with.capacities.is_some());
}

//! The cluster's fixed objects: namespaces, drivers, the six classes, and the ticker objects
//! that keep every watch moving.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node, PersistentVolume, PersistentVolumeClaim, ServiceAccount};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use stowage_testkit::builders;

use crate::workload::{CLASSES, EXT_DRIVER, LOOP_DRIVER, NS};

pub(crate) const TICKER: &str = "soak-ticker";

/// The namespace, drivers, classes and the ticker objects.
pub(crate) async fn setup_objects(client: &Client) -> anyhow::Result<()> {
    let pp = PostParams::default();
    for ns in [NS, TICKER] {
        let (n, sa) = builders::namespace(ns);
        Api::<Namespace>::all(client.clone()).create(&pp, &n).await?;
        Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .create(&pp, &sa)
            .await?;
    }
    let drivers: Api<CSIDriver> = Api::all(client.clone());
    drivers
        .create(&pp, &builders::csi_driver(LOOP_DRIVER, true))
        .await?;
    // Nothing attaches the external driver's volumes here; pods of it are objects only.
    drivers
        .create(&pp, &builders::csi_driver(EXT_DRIVER, false))
        .await?;
    let classes: Api<StorageClass> = Api::all(client.clone());
    for c in &CLASSES {
        let mut b = builders::storage_class(c.name, if c.looped { LOOP_DRIVER } else { EXT_DRIVER })
            .reclaim(if c.retain { "Retain" } else { "Delete" })
            .allow_expansion(c.looped);
        if c.wffc {
            b = b.wait_for_first_consumer();
        }
        classes.create(&pp, &b.build()).await?;
    }
    // Objects patched every second so each watch keeps moving even when nothing else changes:
    // the observer judges cross-kind invariants only up to what every watch has delivered.
    Api::<Node>::all(client.clone())
        .create(&pp, &builders::node(TICKER).build())
        .await?;
    Api::<PersistentVolume>::all(client.clone())
        .create(
            &pp,
            &builders::pv(TICKER)
                .class("soak-ticker-volume")
                .driver("ticker.soak.stowage.dev", TICKER)
                .build(),
        )
        .await?;
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), TICKER)
        .create(
            &pp,
            &builders::pvc(TICKER, TICKER).class("soak-ticker-claim").build(),
        )
        .await?;
    Ok(())
}

pub(crate) async fn ticker(client: Client) {
    let mut n = 0u64;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        n += 1;
        let patch =
            serde_json::json!({"metadata": {"annotations": {"soak.stowage.dev/tick": n.to_string()}}});
        let pp = PatchParams::default();
        let _ = Api::<Node>::all(client.clone())
            .patch(TICKER, &pp, &Patch::Merge(&patch))
            .await;
        let _ = Api::<PersistentVolume>::all(client.clone())
            .patch(TICKER, &pp, &Patch::Merge(&patch))
            .await;
        let _ = Api::<PersistentVolumeClaim>::namespaced(client.clone(), TICKER)
            .patch(TICKER, &pp, &Patch::Merge(&patch))
            .await;
    }
}

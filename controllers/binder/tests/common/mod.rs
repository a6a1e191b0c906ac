//! A binder running in-process against its own real control plane, so tests never see each
//! other's volumes.

#![allow(dead_code)]

use std::time::Duration;

use kube::api::{Patch, PatchParams};
use stowage_testkit::InProcess;
pub use stowage_testkit::inproc::WAIT;

stowage_testkit::in_process_harness!(
    /// The binder in-process; everything generic comes from `InProcess` (by deref).
    Harness
);

impl Harness {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tune: impl FnOnce(&mut stowage_binder::Config)) -> Self {
        let mut h = InProcess::new().await;
        let cluster = h.cluster().await;
        let metrics = stowage_binder::Metrics::new(&h.registry);
        let mut config = stowage_binder::Config {
            resync: Duration::from_secs(15),
            image_dir: h.images.path().to_path_buf(),
            max_in_flight: 64,
            store_mode: Default::default(),
        };
        tune(&mut config);
        h.run(stowage_binder::run(cluster, metrics, config));
        Self(h)
    }

    /// Waits for an event with `reason` about object `name` (any namespace), returning its note.
    pub async fn event(&self, name: &str, reason: &str) -> String {
        self.wait_event(None, name, reason).await
    }

    /// What the pvc-protection controller would do once the claim is unused (it is not under
    /// test here): drop the finalizer so deletion completes.
    pub async fn delete_claim(&self, ns: &str, name: &str) {
        let api = self.pvcs(ns);
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        api.delete(name, &Default::default()).await.unwrap();
    }

    pub async fn delete_volume(&self, name: &str) {
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        self.pvs()
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        let _ = self.pvs().delete(name, &Default::default()).await;
    }
}

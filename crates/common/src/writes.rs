//! Full-object writes of PVs and claims, counted per operation. A PUT carries the
//! resourceVersion of the object it was computed from, so a write made on a stale view fails
//! with 409 instead of overwriting someone else's change.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use prometheus::IntCounterVec;

#[derive(Clone)]
pub struct Writes {
    client: Client,
    /// Counter with one label, the operation name.
    counter: IntCounterVec,
}

/// Whether an error is a resourceVersion conflict (someone wrote first).
pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

impl Writes {
    pub fn new(client: Client, counter: IntCounterVec) -> Self {
        Self { client, counter }
    }

    fn claims(&self, c: &PersistentVolumeClaim) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), &c.namespace().unwrap_or_default())
    }

    fn pvs(&self) -> Api<PersistentVolume> {
        Api::all(self.client.clone())
    }

    fn count(&self, op: &str) {
        self.counter.with_label_values(&[op]).inc();
    }

    pub async fn replace_pv(&self, pv: &PersistentVolume, op: &str) -> kube::Result<PersistentVolume> {
        self.count(op);
        self.pvs()
            .replace(&pv.name_any(), &PostParams::default(), pv)
            .await
    }

    pub async fn replace_pv_status(&self, pv: &PersistentVolume, op: &str) -> kube::Result<PersistentVolume> {
        self.count(op);
        self.pvs()
            .replace_status(&pv.name_any(), &PostParams::default(), pv)
            .await
    }

    pub async fn replace_claim(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> kube::Result<PersistentVolumeClaim> {
        self.count(op);
        self.claims(c)
            .replace(&c.name_any(), &PostParams::default(), c)
            .await
    }

    pub async fn replace_claim_status(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> kube::Result<PersistentVolumeClaim> {
        self.count(op);
        self.claims(c)
            .replace_status(&c.name_any(), &PostParams::default(), c)
            .await
    }
}

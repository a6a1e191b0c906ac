//! Full-object writes of PVs and claims, counted per operation. A PUT carries the
//! resourceVersion of the object it was computed from, so a write made on a stale view fails
//! with 409 instead of overwriting someone else's change.

use std::fmt::Debug;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::PostParams;
use kube::{Api, Client, Resource, ResourceExt};
use prometheus::IntCounterVec;
use serde::Serialize;
use serde::de::DeserializeOwned;

#[derive(Clone)]
pub struct Writes {
    client: Client,
    /// Counter with one label, the operation name.
    counter: IntCounterVec,
}

/// Which part of an object a PUT replaces.
enum Part {
    Object,
    Status,
}

pub use crate::errors::{is_conflict, is_not_found};

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

    /// One counted PUT of `obj`, or of its status subresource.
    async fn put<K>(&self, api: Api<K>, obj: &K, op: &str, part: Part) -> kube::Result<K>
    where
        K: Resource + Clone + DeserializeOwned + Serialize + Debug,
    {
        self.count(op);
        let (name, pp) = (obj.name_any(), PostParams::default());
        match part {
            Part::Object => api.replace(&name, &pp, obj).await,
            Part::Status => api.replace_status(&name, &pp, obj).await,
        }
    }

    pub async fn replace_pv(&self, pv: &PersistentVolume, op: &str) -> kube::Result<PersistentVolume> {
        self.put(self.pvs(), pv, op, Part::Object).await
    }

    pub async fn replace_pv_status(&self, pv: &PersistentVolume, op: &str) -> kube::Result<PersistentVolume> {
        self.put(self.pvs(), pv, op, Part::Status).await
    }

    pub async fn replace_claim(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> kube::Result<PersistentVolumeClaim> {
        self.put(self.claims(c), c, op, Part::Object).await
    }

    pub async fn replace_claim_status(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> kube::Result<PersistentVolumeClaim> {
        self.put(self.claims(c), c, op, Part::Status).await
    }
}

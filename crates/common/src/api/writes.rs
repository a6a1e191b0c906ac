//! Full-object writes of PVs and claims, counted per operation. A PUT carries the
//! resourceVersion of the object it was computed from, so a write made on a stale view fails
//! with 409 instead of overwriting someone else's change.

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::api::PostParams;
use kube::{Client, Resource, ResourceExt};
use prometheus::IntCounterVec;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api::lean::Lean;

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

    fn count(&self, op: &str) {
        self.counter.with_label_values(&[op]).inc();
    }

    /// One counted PUT of `obj`, or of its status subresource. As `Api::replace` and
    /// `Api::replace_status` send it, but the object that comes back is decoded `Lean` (without
    /// managed fields): `Api<K>` would take and return `K`, and these objects are borrowed.
    async fn put<K>(&self, obj: &K, op: &str, part: Part) -> kube::Result<K>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Serialize,
    {
        self.count(op);
        let (name, pp) = (obj.name_any(), PostParams::default());
        let body = serde_json::to_vec(obj).map_err(kube::Error::SerdeError)?;
        let req = kube::core::Request::new(K::url_path(&(), obj.meta().namespace.as_deref()));
        let (req, verb) = match part {
            Part::Object => (req.replace(&name, &pp, body), "replace"),
            Part::Status => (
                req.replace_subresource("status", &name, &pp, body),
                "replace_status",
            ),
        };
        let mut req = req.map_err(kube::Error::BuildRequest)?;
        // As `Api` names its requests (kube-client reads it for its tracing spans).
        req.extensions_mut().insert(verb);
        self.client.request::<Lean<K>>(req).await.map(Lean::into_inner)
    }

    pub async fn replace_pv(&self, pv: &PersistentVolume, op: &str) -> kube::Result<PersistentVolume> {
        self.put(pv, op, Part::Object).await
    }

    pub async fn replace_pv_status(&self, pv: &PersistentVolume, op: &str) -> kube::Result<PersistentVolume> {
        self.put(pv, op, Part::Status).await
    }

    pub async fn replace_claim(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> kube::Result<PersistentVolumeClaim> {
        self.put(c, op, Part::Object).await
    }

    pub async fn replace_claim_status(
        &self,
        c: &PersistentVolumeClaim,
        op: &str,
    ) -> kube::Result<PersistentVolumeClaim> {
        self.put(c, op, Part::Status).await
    }
}

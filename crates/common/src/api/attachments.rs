//! VolumeAttachment writes whose answers come back as the read model's [`VolumeAttachment`], decoded
//! without managed fields (as the informers decode them), so a write's result and a watch event
//! are the same form.

use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};

use crate::api::lean::Lean;
use crate::api::volumeattachment::VolumeAttachment;

#[derive(Clone)]
pub struct Attachments {
    api: Api<Lean<VolumeAttachment>>,
}

impl Attachments {
    pub fn new(client: Client) -> Self {
        Self {
            api: Api::all(client),
        }
    }

    pub async fn create(&self, va: VolumeAttachment) -> kube::Result<VolumeAttachment> {
        self.api
            .create(&PostParams::default(), &Lean(va))
            .await
            .map(Lean::into_inner)
    }

    /// A JSON merge patch of VolumeAttachment `name`.
    pub async fn merge_patch(&self, name: &str, patch: &serde_json::Value) -> kube::Result<VolumeAttachment> {
        self.api
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .map(Lean::into_inner)
    }

    /// Deletes VolumeAttachment `name`. `Some` is the object when the apiserver answered with it
    /// (still there, held by finalizers, or as it was when removed at once); `None` when it
    /// answered with a status.
    pub async fn delete(&self, name: &str) -> kube::Result<Option<VolumeAttachment>> {
        self.api
            .delete(name, &DeleteParams::default())
            .await
            .map(|either| either.left().map(Lean::into_inner))
    }
}

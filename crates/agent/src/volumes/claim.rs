//! Finishing a node-side expansion in the claim's status, as the kubelet does.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::api::{Patch, PatchParams};

use stowage_common::vocab::resize;

use crate::ctx::Ctx;

/// Finishes a node-side expansion in the claim's status the way the kubelet does
/// (`resize::finished_patch`). Returns the new resourceVersion. Guarded by the resourceVersion
/// read, so a concurrent change wins.
pub async fn finish_claim_resize(ctx: &Ctx, ns: &str, name: &str, size: &str) -> anyhow::Result<String> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.client.clone(), ns);
    let pvc = api.get_status(name).await?;
    let patch = resize::finished_patch(&pvc, size);
    let out = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(out.metadata.resource_version.unwrap_or_default())
}

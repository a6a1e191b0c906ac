//! Local mode: this node's share of provisioning. Each node has its own image store, so the
//! images of the volumes pinned to this node (node affinity `TOPOLOGY_KEY In [this node]`) are
//! made and removed here, never by the controller. The binder stays the one that decides and
//! binds: it creates the PV (image pending) for the node the scheduler chose, and asks for the
//! deletion (`ANN_DELETE_IMAGE`) once its checks have passed; this loop carries both out, the way
//! TopoLVM's node reconciler fulfils the controller's LogicalVolume objects.
//!
//! A made image records its store's id on the PV (`ANN_STORE_ID`): a node whose store has another
//! id (another disk mounted at the path, a store initialized again) refuses to delete it, and the
//! attacher refuses to attach it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Resource, ResourceExt};
use stowage_common::observe::events::{Occurrence, Subject};
use stowage_common::store::informer::{Change, is_newer};
use stowage_common::store::pv::*;
use stowage_common::vocab::annotations::*;
use stowage_loopdriver::{DRIVER, ImageError, TOPOLOGY_KEY};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ctx::Ctx;
use crate::volumes::REPEAT;

/// Event reasons.
pub const PROVISIONED: &str = "ProvisioningSucceeded";
pub const PROVISION_FAILED: &str = "ProvisioningFailed";
pub const STORE_MISMATCH: &str = "VolumeStoreMismatch";
pub const IMAGE_MISSING: &str = "VolumeImageMissing";
pub const DELETE_FAILED: &str = "VolumeFailedDelete";
pub const RESIZE_FAILED: &str = "VolumeResizeFailed";

/// A pass over every volume also runs this often without a change (a failed step's retry is due,
/// a store mounted late).
const PERIOD: Duration = Duration::from_secs(10);
const FIRST_RETRY: Duration = Duration::from_secs(1);
const MAX_RETRY: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageOp {
    /// The PV waits for its image (`ANN_IMAGE_PENDING`): make it, then clear the annotation.
    Create,
    /// The binder decided the image goes (`ANN_DELETE_IMAGE`): remove it, the deleter finalizer,
    /// and the PV.
    Delete,
    /// The PV's capacity is not the one last ensured here (the expand controller recorded a new
    /// size, or this agent just started): grow the image to it, before any pod needs it, so the
    /// next stage finds the larger device and grows the file system offline.
    Grow,
}

impl ImageOp {
    fn name(self) -> &'static str {
        match self {
            ImageOp::Create => "create_image",
            ImageOp::Delete => "delete_image",
            ImageOp::Grow => "grow_image",
        }
    }
}

/// Whether a PV is one this node may owe anything: a volume this driver provisioned, pinned to
/// this node. The loop keeps an index of these, so a change elsewhere in a cluster of many
/// volumes costs one check, not a pass over every PV.
pub fn pinned_here(pv: &PersistentVolume, node: &str) -> bool {
    pv.spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .is_some_and(|c| c.driver == DRIVER)
        && ann(pv, ANN_PROVISIONED_BY) == Some(DRIVER)
        && affinity_value(pv, TOPOLOGY_KEY) == Some(node)
}

/// What this node owes a PV's image: only volumes this driver provisioned, pinned to this node.
/// `ensured`: the capacity this agent last made the image hold.
pub fn decide(pv: &PersistentVolume, node: &str, ensured: Option<u128>) -> Option<ImageOp> {
    if !pinned_here(pv, node) {
        return None;
    }
    if has_ann(pv, ANN_DELETE_IMAGE) {
        return Some(ImageOp::Delete);
    }
    if has_ann(pv, ANN_IMAGE_PENDING) {
        // Failed = creation failed for good; its claim says why and deleting it cleans up.
        return (pv_phase(pv) != "Failed" && !being_deleted(pv)).then_some(ImageOp::Create);
    }
    let capacity = pv_capacity(pv)?;
    (ensured != Some(capacity) && !being_deleted(pv)).then_some(ImageOp::Grow)
}

/// Why a step did not finish; `permanent` when no retry can fix it.
struct StepError {
    message: String,
    reason: &'static str,
    permanent: bool,
}

impl StepError {
    fn retry(reason: &'static str, message: String) -> Self {
        Self {
            message,
            reason,
            permanent: false,
        }
    }
}

/// Off the async threads: file-system calls may block on a slow disk.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, StepError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StepError::retry(PROVISION_FAILED, format!("image step failed: {e}")))
}

/// The store's marker id, read now (never a cached answer before creating or deleting). A
/// node's own store is marked here when it has no marker yet (local mode needs no install step):
/// should a disk be mounted over it later, that disk's store gets an id of its own, and the
/// volumes made before are refused there instead of being looked for on the wrong disk.
async fn store_id(ctx: &Ctx) -> Result<String, StepError> {
    let store = ctx.images.clone();
    blocking(move || match store.ready_now() {
        Err(stowage_loopdriver::NotReady::NoMarker { .. }) => {
            let (m, made) = store.init().map_err(|e| e.to_string())?;
            if made {
                tracing::info!(dir = %store.dir().display(), id = %m.id, "marked this node's image store");
            }
            store.ready_now().map(|m| m.id).map_err(|e| e.to_string())
        }
        r => r.map(|m| m.id).map_err(|e| e.to_string()),
    })
    .await?
    .map_err(|e| StepError::retry(crate::store::NOT_READY, e))
}

/// The index of this node's volumes (by name), kept from the PV feed.
#[derive(Debug, Default)]
pub struct Index {
    names: HashSet<String>,
    /// A relist (or a feed that fell behind): rebuild from the store before the next pass.
    stale: bool,
}

impl Index {
    pub fn rebuild<'a>(&mut self, pvs: impl IntoIterator<Item = &'a PersistentVolume>, node: &str) {
        self.names = pvs
            .into_iter()
            .filter(|pv| pinned_here(pv, node))
            .map(|pv| pv.name_any())
            .collect();
        self.stale = false;
    }

    pub fn apply(&mut self, change: &Change<PersistentVolume>, node: &str) {
        match change {
            Change::Applied(pv) if pinned_here(pv, node) => {
                self.names.insert(pv.name_any());
            }
            // Re-pinned elsewhere (never by this driver, but a hand edit may), or gone.
            Change::Applied(pv) | Change::Deleted(pv) => {
                self.names.remove(&pv.name_any());
            }
            Change::Resynced => self.stale = true,
        }
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.names.iter()
    }
}

/// The events gate's subject of one volume's image step.
fn subject(pv: &str, op: ImageOp) -> Subject {
    Subject::new("image", pv).about(op.name())
}

pub async fn run(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    ctx.pvs.ready().await;
    let mut feed = ctx.pvs.feed();
    let mut index = Index::default();
    index.rebuild(ctx.pvs.store().state().iter().map(|p| p.as_ref()), &ctx.node);
    // PV → (failures in a row, next try, the step that failed): a failing image step backs off
    // on its own.
    let mut failing: HashMap<String, (u32, Instant, ImageOp)> = HashMap::new();
    // PV → resourceVersion this loop wrote, until the cache has caught up with it.
    let mut written: HashMap<String, String> = HashMap::new();
    // PV → the capacity its image was last made to hold here.
    let mut ensured: HashMap<String, u128> = HashMap::new();
    tracing::info!(dir = %ctx.images.dir().display(), "local image store: this node makes and deletes its volumes' images");
    if let Err(e) = store_id(&ctx).await {
        tracing::warn!(error = %e.message, "image store not ready");
    }
    loop {
        if index.stale {
            index.rebuild(ctx.pvs.store().state().iter().map(|p| p.as_ref()), &ctx.node);
        }
        let now = Instant::now();
        let mut due = Vec::new();
        for name in index.names() {
            let Some(pv) = ctx.pv(name) else { continue };
            if let Some(rv) = written.get(name) {
                if is_newer(Some(rv), pv.metadata.resource_version.as_deref()) {
                    continue;
                }
                written.remove(name);
            }
            match decide(&pv, &ctx.node, ensured.get(name).copied()) {
                Some(op) if failing.get(name).is_none_or(|(_, at, _)| *at <= now) => due.push((pv, op)),
                Some(_) => {}
                None => {
                    if let Some((_, _, op)) = failing.remove(name) {
                        ctx.events.forget(&subject(name, op));
                    }
                }
            }
        }
        // Volumes no longer this node's need no entry.
        ensured.retain(|n, _| index.names.contains(n));
        written.retain(|n, _| index.names.contains(n));
        failing.retain(|n, (_, _, op)| {
            let keep = index.names.contains(n);
            if !keep {
                ctx.events.forget(&subject(n, *op));
            }
            keep
        });
        for (pv, op) in due {
            let name = pv.name_any();
            let started = std::time::Instant::now();
            let r = match op {
                ImageOp::Create => create(&ctx, &pv).await,
                ImageOp::Delete => delete(&ctx, &pv).await,
                ImageOp::Grow => grow(&ctx, &pv).await.map(|capacity| {
                    ensured.insert(name.clone(), capacity);
                    None
                }),
            };
            ctx.metrics.record(op.name(), started, r.is_ok());
            match r {
                Ok(rv) => {
                    if failing.remove(&name).is_some() {
                        ctx.events.forget(&subject(&name, op));
                    }
                    ctx.capacity_changed.notify_one();
                    if let Some(rv) = rv {
                        written.insert(name, rv);
                    }
                }
                Err(e) => {
                    tracing::warn!(pv = %name, op = op.name(), error = %e.message, "image step failed");
                    report(&ctx, &pv, op, &e);
                    if e.permanent {
                        failing.remove(&name);
                    } else {
                        let n = failing.get(&name).map_or(0, |(n, _, _)| *n) + 1;
                        let wait = FIRST_RETRY.saturating_mul(1 << n.min(16)).min(MAX_RETRY);
                        failing.insert(name, (n, Instant::now() + wait, op));
                    }
                }
            }
        }
        let next_retry = failing.values().map(|(_, at, _)| *at).min();
        let sleep = next_retry.map_or(PERIOD, |at| {
            at.saturating_duration_since(Instant::now()).min(PERIOD)
        });
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            r = feed.next() => match r {
                Ok(c) => index.apply(&c, &ctx.node),
                Err(e) => {
                    tracing::error!(error = %e, "the persistentvolumes watch ended");
                    return;
                }
            },
            _ = tokio::time::sleep(sleep) => {}
        }
        // One pass covers every change that arrived meanwhile.
        loop {
            match feed.try_next() {
                Ok(Some(c)) => index.apply(&c, &ctx.node),
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "the persistentvolumes watch ended");
                    return;
                }
            }
        }
    }
}

/// The Warning for a failed step: on the claim while the volume is being made (that is where
/// `kubectl describe pvc` looks), on the volume when it is being deleted.
fn report(ctx: &Ctx, pv: &PersistentVolume, op: ImageOp, e: &StepError) {
    let on = match (op, pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref())) {
        (ImageOp::Create, Some(c)) => c.clone(),
        _ => pv.object_ref(&()),
    };
    let note = match e.permanent {
        true => e.message.clone(),
        false => format!("{}; retrying", e.message),
    };
    let o = Occurrence {
        warning: true,
        reason: e.reason,
        action: op.name(),
        note,
    };
    ctx.events
        .report(&self::subject(&pv.name_any(), op), REPEAT, &on, o);
}

/// Makes the image (and, for a ReadOnlyMany volume, its file system), then clears the pending
/// annotation and records the store's id, on the object read, so a concurrent change wins.
/// Returns the resourceVersion written.
async fn create(ctx: &Ctx, pv: &PersistentVolume) -> Result<Option<String>, StepError> {
    let name = pv.name_any();
    let handle = volume_handle(pv).unwrap_or_default().to_string();
    let capacity = pv_capacity(pv).unwrap_or(0);
    let id = store_id(ctx).await?;
    let size = u64::try_from(capacity).map_err(|_| StepError {
        message: format!("volume {name}: {capacity} bytes is more than a file can hold"),
        reason: PROVISION_FAILED,
        permanent: true,
    })?;
    let (store, h) = (ctx.images.clone(), handle.clone());
    let made = blocking(move || store.ensure(&h, size)).await?;
    // The volume's own file system (a node-local volume may be XFS).
    let fs = csi_fs_type(pv)
        .and_then(|t| stowage_loopdriver::csi::caps::fs_type(t).ok())
        .unwrap_or(stowage_loopdriver::csi::caps::FS_TYPE);
    let made = match made {
        Ok((path, _)) if formatted_at_creation(pv, fs) => {
            stowage_loopdriver::image::format_new_image(&path, fs).await
        }
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = made {
        let msg = format!(
            "cannot create the {capacity}-byte image of volume {name} on node {}: {e}",
            ctx.node
        );
        if e.permanent() {
            // Still pending, so nothing binds to it; Failed tells the binder and the claim why.
            fail_volume(ctx, pv, &msg).await?;
            return Err(StepError {
                message: msg,
                reason: PROVISION_FAILED,
                permanent: true,
            });
        }
        return Err(StepError::retry(PROVISION_FAILED, msg));
    }
    let mut next = pv.clone();
    next.annotations_mut().remove(ANN_IMAGE_PENDING);
    next.annotations_mut().insert(ANN_STORE_ID.into(), id);
    let api: Api<PersistentVolume> = Api::all(ctx.client.clone());
    let written = api
        .replace(&name, &PostParams::default(), &next)
        .await
        .map_err(|e| StepError::retry(PROVISION_FAILED, format!("cannot update volume {name}: {e}")))?;
    tracing::info!(pv = %name, image = %handle, "image created in this node's store");
    if let Some(claim) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) {
        let note = format!(
            "Successfully provisioned volume {name} (image {handle}.img on node {})",
            ctx.node
        );
        ctx.events.normal(claim, PROVISIONED, "Provision", note);
    }
    Ok(written.resource_version())
}

/// A volume whose image can never be made: phase Failed with the reason (the binder then
/// reports it on the claim and reclaims the volume with it).
async fn fail_volume(ctx: &Ctx, pv: &PersistentVolume, msg: &str) -> Result<(), StepError> {
    let mut next = pv.clone();
    let status = next.status.get_or_insert_with(Default::default);
    status.phase = Some("Failed".into());
    status.message = Some(msg.into());
    let api: Api<PersistentVolume> = Api::all(ctx.client.clone());
    api.replace_status(&pv.name_any(), &PostParams::default(), &next)
        .await
        .map(|_| ())
        .map_err(|e| {
            StepError::retry(
                PROVISION_FAILED,
                format!("cannot mark volume {} Failed: {e}", pv.name_any()),
            )
        })
}

/// Grows the image to the PV's capacity (never shrinks, never creates: a missing image is an
/// error to report); the capacity now ensured.
async fn grow(ctx: &Ctx, pv: &PersistentVolume) -> Result<u128, StepError> {
    let name = pv.name_any();
    let handle = volume_handle(pv).unwrap_or_default().to_string();
    let capacity = pv_capacity(pv).unwrap_or(0);
    let bytes = u64::try_from(capacity).map_err(|_| StepError {
        message: format!("volume {name}: {capacity} bytes is more than a file can hold"),
        reason: RESIZE_FAILED,
        permanent: true,
    })?;
    let (store, h) = (ctx.images.clone(), handle.clone());
    let before = blocking({
        let (store, h) = (store.clone(), h.clone());
        move || store.size(&h)
    })
    .await?
    .map_err(|e| StepError::retry(RESIZE_FAILED, format!("volume {name}: {e}")))?;
    if before < bytes {
        blocking(move || store.grow(&h, bytes)).await?.map_err(|e| {
            StepError::retry(
                RESIZE_FAILED,
                format!("cannot grow the image of volume {name}: {e}"),
            )
        })?;
        tracing::info!(pv = %name, from = before, to = bytes, "image grown to the volume's capacity");
        ctx.capacity_changed.notify_one();
    }
    Ok(capacity)
}

/// Removes the image (never one of another store, never one a loop device here still holds),
/// then the deleter finalizer and the PV object.
async fn delete(ctx: &Ctx, pv: &PersistentVolume) -> Result<Option<String>, StepError> {
    let name = pv.name_any();
    let handle = volume_handle(pv).unwrap_or_default().to_string();
    let id = store_id(ctx).await?;
    if let Some(want) = ann(pv, ANN_STORE_ID)
        && want != id
    {
        return Err(StepError::retry(
            STORE_MISMATCH,
            store_mismatch(&name, want, &id, &ctx.node, ctx.images.dir()),
        ));
    }
    let image = ctx.images.path(&handle).map_err(|e| StepError {
        message: format!("volume {name}: {e}; nothing was deleted"),
        reason: DELETE_FAILED,
        permanent: true,
    })?;
    let held = crate::sys::loops_of(&image)
        .await
        .map_err(|e| StepError::retry(DELETE_FAILED, format!("cannot list loop devices: {e}")))?;
    if !held.is_empty() {
        return Err(StepError::retry(
            DELETE_FAILED,
            format!(
                "the image of volume {name} is still held by loop device(s) {} on node {}; it is deleted once they are released",
                held.join(", "),
                ctx.node
            ),
        ));
    }
    let (store, h) = (ctx.images.clone(), handle.clone());
    let removed = blocking(move || {
        let removed = store.remove(&h)?;
        // "Already gone" from a store unmounted a moment ago is not gone: read the marker again.
        if !removed {
            store.ready_now().map_err(|e| ImageError::Io {
                path: store.dir().to_path_buf(),
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        Ok::<_, ImageError>(removed)
    })
    .await?
    .map_err(|e| {
        StepError::retry(
            DELETE_FAILED,
            format!("cannot delete the image of volume {name}: {e}"),
        )
    })?;
    if !removed {
        let note = format!(
            "image of volume {name} was already gone from node {}'s store; deleting the volume object",
            ctx.node
        );
        ctx.events
            .normal(&pv.object_ref(&()), IMAGE_MISSING, "Delete", note);
    }
    tracing::info!(pv = %name, image = %handle, "image deleted from this node's store");
    let api: Api<PersistentVolume> = Api::all(ctx.client.clone());
    if pv.finalizers().iter().any(|f| f == FINALIZER_LOOP_DELETER) {
        let mut next = pv.clone();
        next.finalizers_mut().retain(|f| f != FINALIZER_LOOP_DELETER);
        match api.replace(&name, &PostParams::default(), &next).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
            Err(e) => {
                return Err(StepError::retry(
                    DELETE_FAILED,
                    format!("cannot remove the finalizer of volume {name}: {e}"),
                ));
            }
        }
    }
    match api.delete(&name, &DeleteParams::default()).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(StepError::retry(
            DELETE_FAILED,
            format!("cannot delete volume {name}: {e}"),
        )),
    }
}

/// The refusal of a volume whose image was made in another store than the one at this path.
pub fn store_mismatch(pv: &str, want: &str, have: &str, node: &str, dir: &std::path::Path) -> String {
    format!(
        "the image of volume {pv} was made in image store {want}, but the store at {} on node {node} is {have} (another disk or a store initialized again is mounted there); nothing is attached or deleted: mount the volume's store there again, or delete the volume by hand",
        dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
        PersistentVolumeSpec, VolumeNodeAffinity,
    };

    fn volume(node: &str, anns: &[(&str, &str)]) -> PersistentVolume {
        let mut pv = PersistentVolume {
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: DRIVER.into(),
                    volume_handle: "pvc-1".into(),
                    ..Default::default()
                }),
                node_affinity: Some(VolumeNodeAffinity {
                    required: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: TOPOLOGY_KEY.into(),
                                operator: "In".into(),
                                values: Some(vec![node.into()]),
                            }]),
                            match_fields: None,
                        }],
                    }),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        pv.metadata.name = Some("pvc-1".into());
        pv.annotations_mut()
            .insert(ANN_PROVISIONED_BY.into(), DRIVER.into());
        for (k, v) in anns {
            pv.annotations_mut().insert(k.to_string(), v.to_string());
        }
        pv
    }

    #[test]
    fn only_this_nodes_provisioned_volumes_are_acted_on() {
        let pending = volume("a", &[(ANN_IMAGE_PENDING, "true")]);
        assert_eq!(decide(&pending, "a", None), Some(ImageOp::Create));
        assert_eq!(decide(&pending, "b", None), None, "another node's volume");
        let mut by_hand = pending.clone();
        by_hand.annotations_mut().remove(ANN_PROVISIONED_BY);
        assert_eq!(
            decide(&by_hand, "a", None),
            None,
            "a volume made by hand is never touched"
        );
        let mut other = pending.clone();
        other.spec.as_mut().unwrap().csi.as_mut().unwrap().driver = "other.example.com".into();
        assert_eq!(decide(&other, "a", None), None);
        let mut shared = pending.clone();
        shared.spec.as_mut().unwrap().node_affinity = None;
        assert_eq!(
            decide(&shared, "a", None),
            None,
            "a shared-store volume is the controller's"
        );
        assert_eq!(
            decide(&volume("a", &[]), "a", None),
            None,
            "made already: nothing to do"
        );
    }

    #[test]
    fn the_index_holds_this_nodes_volumes_only() {
        let mine = Arc::new(volume("a", &[]));
        let mut theirs = volume("b", &[]);
        theirs.metadata.name = Some("pvc-2".into());
        let theirs = Arc::new(theirs);
        let mut index = Index::default();
        index.rebuild([mine.as_ref(), theirs.as_ref()], "a");
        assert_eq!(index.names().collect::<Vec<_>>(), vec!["pvc-1"]);
        index.apply(&Change::Deleted(mine.clone()), "a");
        assert_eq!(index.names().count(), 0);
        index.apply(&Change::Applied(theirs.clone()), "a");
        assert_eq!(index.names().count(), 0, "another node's volume is not indexed");
        index.apply(&Change::Applied(mine.clone()), "a");
        assert_eq!(index.names().collect::<Vec<_>>(), vec!["pvc-1"]);
        // Re-pinned by a hand edit: no longer this node's.
        let mut moved = (*mine).clone();
        moved.spec.as_mut().unwrap().node_affinity = None;
        index.apply(&Change::Applied(Arc::new(moved)), "a");
        assert_eq!(index.names().count(), 0);
        index.apply(&Change::Resynced, "a");
        assert!(index.stale, "a relist rebuilds the index from the store");
    }

    #[test]
    fn deletion_needs_the_binders_request_and_creation_stops_at_failed() {
        let requested = volume("a", &[(ANN_DELETE_IMAGE, "true"), (ANN_IMAGE_PENDING, "true")]);
        assert_eq!(decide(&requested, "a", None), Some(ImageOp::Delete));
        let mut deleting = volume("a", &[]);
        deleting.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
        assert_eq!(
            decide(&deleting, "a", None),
            None,
            "a deleted PV alone (kubectl delete pv) never removes an image: only the binder's decision does"
        );
        let mut failed = volume("a", &[(ANN_IMAGE_PENDING, "true")]);
        failed.status = Some(k8s_openapi::api::core::v1::PersistentVolumeStatus {
            phase: Some("Failed".into()),
            ..Default::default()
        });
        assert_eq!(decide(&failed, "a", None), None);
    }
}

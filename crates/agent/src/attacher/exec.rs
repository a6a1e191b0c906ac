//! One attacher operation: the loop device steps (attach, and a detach only once nothing on the
//! node uses the device) and the VolumeAttachment writes that report them.

use std::path::Path;

use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};

use super::{VaAction, lost_device};
use crate::ctx::Ctx;
use crate::mountinfo;
use crate::paths::{DRIVER, VA_FINALIZER};
use crate::sys;
use stowage_common::observe::events::{Occurrence, Subject};
use stowage_common::store::pv::ann;
use stowage_common::vocab::annotations::{ANN_STORE_ID, is_loop_attacher_finalizer};
use stowage_loopdriver::fence;

/// For an attached VA: does the device in its status still back its image?
pub(super) async fn device_ok(ctx: &Ctx, va: &VolumeAttachment) -> Option<bool> {
    let st = va.status.as_ref().filter(|s| s.attached)?;
    let dev = st.attachment_metadata.as_ref()?.get("devicePath")?;
    let handle = handle_of(ctx, va)?;
    let image = ctx.images.path(&handle).ok()?;
    Some(sys::backs(dev, &image).await)
}

/// The volume handle: from the PV, else from what we wrote into the status at attach time (the
/// PV may be gone by the time the attachment is deleted).
fn handle_of(ctx: &Ctx, va: &VolumeAttachment) -> Option<String> {
    let from_pv = va
        .spec
        .source
        .persistent_volume_name
        .as_deref()
        .and_then(|n| ctx.pv(n))
        .and_then(|pv| {
            pv.spec
                .as_ref()?
                .csi
                .as_ref()
                .filter(|c| c.driver == DRIVER)
                .map(|c| c.volume_handle.clone())
        });
    from_pv.or_else(|| {
        va.status
            .as_ref()?
            .attachment_metadata
            .as_ref()?
            .get("volumeHandle")
            .cloned()
    })
}

fn now_time() -> serde_json::Value {
    serde_json::to_value(Time(Timestamp::now())).unwrap_or(serde_json::Value::Null)
}

/// Returns the resourceVersion written when the action succeeded.
pub(super) async fn execute(ctx: &Ctx, va: &VolumeAttachment, action: VaAction) -> Option<String> {
    let api: Api<VolumeAttachment> = Api::all(ctx.client.clone());
    let name = va.name_any();
    match action {
        VaAction::AddFinalizer => {
            let mut fins: Vec<String> = va
                .finalizers()
                .iter()
                .filter(|f| !is_loop_attacher_finalizer(f))
                .cloned()
                .collect();
            fins.push(VA_FINALIZER.into());
            let patch = serde_json::json!({
                "metadata": { "finalizers": fins, "resourceVersion": va.metadata.resource_version }
            });
            match api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(v) => Some(v.resource_version().unwrap_or_default()),
                Err(e) => {
                    tracing::info!(va = %name, error = %e, "cannot add finalizer, will retry");
                    None
                }
            }
        }
        VaAction::Attach => {
            crate::panic_hook::test_hook(
                "attach",
                va.spec
                    .source
                    .persistent_volume_name
                    .as_deref()
                    .unwrap_or_default(),
            );
            let started = std::time::Instant::now();
            let r = attach(ctx, va).await;
            ctx.metrics.record("attach", started, r.is_ok());
            let patch = match &r {
                Ok((dev, handle)) => {
                    tracing::info!(va = %name, device = %dev, "attached");
                    ctx.events.forget(&gate_subject(va, "Attach"));
                    // A re-attach means the device went away under the volume: say so where the
                    // user looks, the mounts on it are broken until they are made again.
                    if let Some(old) = lost_device(va) {
                        let note = format!(
                            "device {old} no longer backs volume {handle} (freed or reused outside the agent); attached again as {dev}"
                        );
                        tracing::warn!(va = %name, "{note}");
                        ctx.events
                            .warning(&va.object_ref(&()), "DeviceLost", "Attach", note);
                    }
                    serde_json::json!({ "status": {
                        "attached": true,
                        "attachmentMetadata": { "devicePath": dev, "volumeHandle": handle },
                        "attachError": null,
                    }})
                }
                Err(msg) => {
                    tracing::warn!(va = %name, error = %msg, "attach failed");
                    say(ctx, va, "FailedAttach", "Attach", msg.clone());
                    serde_json::json!({ "status": {
                        "attached": false,
                        "attachError": { "message": msg, "time": now_time() },
                    }})
                }
            };
            match api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(v) => r.is_ok().then(|| v.resource_version().unwrap_or_default()),
                Err(e) => {
                    tracing::warn!(va = %name, error = %e, "cannot write attachment status");
                    None
                }
            }
        }
        VaAction::Detach => {
            let started = std::time::Instant::now();
            let r = detach(ctx, va).await;
            ctx.metrics.record("detach", started, r.is_ok());
            match r {
                Ok(()) => {
                    ctx.events.forget(&gate_subject(va, "Detach"));
                    let status = serde_json::json!({ "status": {
                        "attached": false, "attachmentMetadata": null, "detachError": null,
                    }});
                    if let Err(e) = api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
                        .await
                        && !is_not_found(&e)
                    {
                        tracing::warn!(va = %name, error = %e, "cannot write detached status");
                    }
                    let fins: Vec<String> = va
                        .finalizers()
                        .iter()
                        .filter(|f| !is_loop_attacher_finalizer(f))
                        .cloned()
                        .collect();
                    let patch = serde_json::json!({ "metadata": { "finalizers": fins } });
                    match api
                        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(v) => {
                            tracing::info!(va = %name, "detached");
                            Some(v.resource_version().unwrap_or_default())
                        }
                        // Gone: nothing of it is left to go stale.
                        Err(e) if is_not_found(&e) => Some(String::new()),
                        Err(e) => {
                            tracing::warn!(va = %name, error = %e, "cannot remove finalizer");
                            None
                        }
                    }
                }
                Err(msg) => {
                    tracing::warn!(va = %name, error = %msg, "detach failed");
                    say(ctx, va, "FailedDetach", "Detach", msg.clone());
                    let patch = serde_json::json!({ "status": {
                        "detachError": { "message": msg, "time": now_time() },
                    }});
                    let _ = api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await;
                    None
                }
            }
        }
    }
}

/// The events gate's subject of one attachment's attach or detach.
fn gate_subject(va: &VolumeAttachment, action: &str) -> Subject {
    Subject::new("volumeattachment", &va.uid().unwrap_or_else(|| va.name_any())).about(action)
}

/// A failed attach or detach, said where `kubectl describe volumeattachment` shows it: at once
/// when it is new or its message changed, then less and less often while it persists (each
/// retry still writes the error into the attachment's status).
fn say(ctx: &Ctx, va: &VolumeAttachment, reason: &str, action: &str, note: String) {
    let o = Occurrence {
        warning: true,
        reason,
        action,
        note,
    };
    ctx.events.report(
        &gate_subject(va, action),
        crate::volumes::REPEAT,
        &va.object_ref(&()),
        o,
    );
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// Attaches the image; returns (device, handle) or the reason in words.
async fn attach(ctx: &Ctx, va: &VolumeAttachment) -> Result<(String, String), String> {
    let pv_name = va
        .spec
        .source
        .persistent_volume_name
        .clone()
        .ok_or("inline volume specs are not supported by loop.stowage.dev; name a PersistentVolume")?;
    let pv = ctx
        .pv(&pv_name)
        .ok_or_else(|| format!("persistentvolume \"{pv_name}\" not found"))?;
    if pv.metadata.deletion_timestamp.is_some() {
        return Err(format!("persistentvolume \"{pv_name}\" is being deleted"));
    }
    let csi = pv
        .spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .filter(|c| c.driver == DRIVER)
        .ok_or_else(|| format!("persistentvolume \"{pv_name}\" is not a {DRIVER} volume"))?;
    let handle = csi.volume_handle.clone();
    let image = ctx
        .images
        .path(&handle)
        .ok()
        .ok_or_else(|| format!("volume handle {handle:?} is not a plain file name"))?;
    // Without the marker this directory may be an empty mount point, not the store: the image
    // is not "missing", and the volume must not be attached from anywhere else.
    let store = ctx.images.clone();
    let marker = tokio::task::spawn_blocking(move || store.ready())
        .await
        .map_err(|e| format!("image store check failed: {e}"))?
        .map_err(|e| format!("image store not ready: {e}"))?;
    // Made in another store (another disk mounted at the path, a store initialized again): its
    // data is not here, and a same-named file here is someone else's.
    if let Some(want) = ann(pv.as_ref(), ANN_STORE_ID)
        && want != marker.id
    {
        return Err(crate::images::store_mismatch(
            &pv_name,
            want,
            &marker.id,
            &ctx.node,
            ctx.images.dir(),
        ));
    }
    match tokio::fs::metadata(&image).await {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(format!("image {} is not a regular file", image.display())),
        Err(e) => {
            // Missing since a cached check: the store may have just been unmounted; say so.
            let store = ctx.images.clone();
            if let Ok(Err(not_ready)) = tokio::task::spawn_blocking(move || store.ready_now()).await {
                return Err(format!("image store not ready: {not_ready}"));
            }
            return Err(format!("image file {} of volume {pv_name}: {e}", image.display()));
        }
    }
    // Local mode: the controller only records a new size on the PV; the node grows the image, and
    // does so before the device is made (or refreshed), so that stage finds the larger device and
    // grows the file system offline, as it does for an image the controller grew in shared mode.
    let grown = match ctx.store_mode.is_local() {
        true => grow_to_capacity(ctx, &pv_name, &handle, &pv).await?,
        false => false,
    };
    let existing = sys::loops_of(&image).await.map_err(|e| e.to_string())?;
    if !existing.is_empty() {
        // A device of the image is adopted (an attach this node made before a restart) unless
        // it is mounted outside this node's root: then it is someone else's (an admin's mount;
        // another node's where one kernel plays several), and sharing its file system would go
        // around multi-mount protection. This node attaches its own device instead, and MMP
        // keeps the two mounts apart.
        let table = mountinfo::read()
            .await
            .map_err(|e| format!("cannot read the mount table: {e}"))?;
        for dev in existing {
            let Some(devno) = sys::rdev(Path::new(&dev)).await else {
                continue;
            };
            let mounts: Vec<bool> = table
                .iter()
                .filter(|m| m.devno == devno)
                .map(|m| m.mount_point.starts_with(&ctx.layout.root))
                .collect();
            // Held (mounted, or open exclusively) yet mounted nowhere in this node's table: held
            // in another mount namespace, such as another node's where each node has its own
            // (the real-node test found node 2 adopting node 1's mounted device, whose file
            // system the kernel then shared without any MMP check).
            let foreign =
                mounts.iter().any(|ours| !ours) || (mounts.is_empty() && fence::held_here(&dev).await);
            if !foreign {
                if grown {
                    sys::loop_refresh(&dev).await.map_err(|e| e.to_string())?;
                }
                return Ok((dev, handle));
            }
        }
    }
    // A volume several nodes may hold (ReadOnlyMany only) gets a read-only device, so no node's
    // kernel can write the shared image, whatever a pod or a mount asks.
    let read_only =
        csi.read_only.unwrap_or(false) || pv.spec.as_ref().is_some_and(crate::state::only_read_only_many);
    let dev = sys::loop_attach(&image, read_only)
        .await
        .map_err(|e| e.to_string())?;
    Ok((dev, handle))
}

/// Grows the image of a node-local volume to the PV's capacity (never shrinks, never creates);
/// whether it grew.
async fn grow_to_capacity(
    ctx: &Ctx,
    pv_name: &str,
    handle: &str,
    pv: &k8s_openapi::api::core::v1::PersistentVolume,
) -> Result<bool, String> {
    let Some(want) = stowage_common::store::pv::pv_capacity(pv).and_then(|c| u64::try_from(c).ok()) else {
        return Ok(false);
    };
    let (store, h) = (ctx.images.clone(), handle.to_string());
    let r = tokio::task::spawn_blocking(move || {
        let before = store.size(&h)?;
        store.grow(&h, want).map(|after| after > before)
    })
    .await
    .map_err(|e| format!("growing the image failed: {e}"))?
    .map_err(|e| format!("cannot grow the image of volume {pv_name} to {want} bytes: {e}"))?;
    if r {
        tracing::info!(pv = %pv_name, bytes = want, "image grown to the volume's capacity before attaching");
    }
    Ok(r)
}

/// Releases every loop device of the image once no mount and no block file uses it.
async fn detach(ctx: &Ctx, va: &VolumeAttachment) -> Result<(), String> {
    let Some(handle) = handle_of(ctx, va) else {
        // Never attached by us (no handle recorded and no PV): nothing to release.
        return Ok(());
    };
    let image = ctx
        .images
        .path(&handle)
        .ok()
        .ok_or_else(|| format!("bad volume handle {handle:?}"))?;
    let mut devices = sys::loops_of(&image).await.map_err(|e| e.to_string())?;
    // The image may be gone; its device then still names it as deleted.
    if let Some(dev) = va
        .status
        .as_ref()
        .and_then(|s| s.attachment_metadata.as_ref())
        .and_then(|m| m.get("devicePath"))
        && !devices.contains(dev)
        && sys::backs(dev, &image).await
    {
        devices.push(dev.clone());
    }
    let table = mountinfo::read()
        .await
        .map_err(|e| format!("cannot read the mount table: {e}"))?;
    let block_files = block_files(&ctx.layout.pods_dir()).await;
    for dev in &devices {
        let Some(users) = users(dev, &table, &block_files).await else {
            continue;
        };
        if !users.is_empty() {
            return Err(format!(
                "device {dev} is still in use on this node: {}",
                users.join(", ")
            ));
        }
    }
    for dev in &devices {
        sys::loop_detach(dev).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// What uses loop device `dev` on this host: mounts of it (a file system, or a devtmpfs bind of
/// its node) and block files published into this node's pods. `None` when `dev` is no device.
pub(super) async fn users(
    dev: &str,
    table: &[mountinfo::MountEntry],
    block_files: &[(String, mountinfo::DevNo)],
) -> Option<Vec<String>> {
    let devno = sys::rdev(Path::new(dev)).await?;
    let node = format!("/{}", dev.trim_start_matches("/dev/"));
    Some(
        table
            .iter()
            .filter(|m| m.devno == devno || (m.fstype == "devtmpfs" && m.root == node))
            .map(|m| m.mount_point.display().to_string())
            .chain(
                block_files
                    .iter()
                    .filter(|(_, d)| *d == devno)
                    .map(|(p, _)| p.clone()),
            )
            .collect(),
    )
}

/// Block device files published into pods: path → device numbers.
pub(super) async fn block_files(pods: &Path) -> Vec<(String, mountinfo::DevNo)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut out = vec![];
    let Ok(mut rd) = tokio::fs::read_dir(pods).await else {
        return out;
    };
    while let Ok(Some(pod)) = rd.next_entry().await {
        let dir = pod
            .path()
            .join("volumeDevices")
            .join(crate::paths::CSI_PLUGIN_DIR);
        let Ok(mut inner) = tokio::fs::read_dir(&dir).await else {
            continue;
        };
        while let Ok(Some(e)) = inner.next_entry().await {
            if let Ok(m) = tokio::fs::symlink_metadata(e.path()).await
                && m.file_type().is_block_device()
            {
                out.push((e.path().display().to_string(), mountinfo::split_dev(m.rdev())));
            }
        }
    }
    out
}

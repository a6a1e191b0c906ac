//! The attacher: what external-attacher does for a CSI driver, done on the node for the loop
//! driver. A VolumeAttachment of this node gets our finalizer first, then its image is attached to
//! a loop device and the status says where; on deletion the device is released (once nothing
//! mounts it) and the finalizer dropped.
//!
//! Each operation runs as a task of its own and reports an `Outcome`, through `owed::Owed`, so a
//! task that panics still reports a failure and its attachment is retried; why this loop keeps
//! its own task set and `Tracker` instead of the shared queue and window is said in `owed.rs`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource, ResourceExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::ctx::{Ctx, is_ours};
use crate::mountinfo;
use crate::owed::Owed;
use crate::paths::{DRIVER, VA_FINALIZER};
use crate::sys;
use crate::tracker::{OpKey, Tracker};
use stowage_common::objects::is_loop_attacher_finalizer;

/// Re-check of attached devices (a node reboot or a manual `losetup -d` frees them).
const VERIFY_PERIOD: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VaAction {
    AddFinalizer,
    Attach,
    Detach,
}

impl VaAction {
    fn kind(self) -> &'static str {
        match self {
            VaAction::AddFinalizer => "finalize",
            VaAction::Attach => "attach",
            VaAction::Detach => "detach",
        }
    }
}

/// What a VolumeAttachment needs. `device_ok` says whether the device its status names still
/// backs the volume's image (`None` when not checked).
pub fn decide(va: &VolumeAttachment, node: &str, device_ok: Option<bool>) -> Option<VaAction> {
    if !is_ours(va, node) {
        return None;
    }
    let fins = va.finalizers();
    if va.metadata.deletion_timestamp.is_some() {
        // The legacy name counts too: a VolumeAttachment from before an upgrade still holds a device.
        return fins
            .iter()
            .any(|f| is_loop_attacher_finalizer(f))
            .then_some(VaAction::Detach);
    }
    if !fins.iter().any(|f| f == VA_FINALIZER) {
        // Before any device exists, so the attachment cannot vanish while holding one. A legacy
        // finalizer is replaced by the current one in the same write.
        return Some(VaAction::AddFinalizer);
    }
    let st = va.status.as_ref();
    let attached = st.is_some_and(|s| s.attached);
    let has_path = st
        .and_then(|s| s.attachment_metadata.as_ref())
        .is_some_and(|m| m.contains_key("devicePath"));
    if !attached || !has_path || device_ok == Some(false) {
        return Some(VaAction::Attach);
    }
    None
}

struct Outcome {
    key: OpKey,
    kind: &'static str,
    /// The resourceVersion a successful op wrote; None when it failed.
    wrote: Option<String>,
}

/// Is the cached VA older than what our last op wrote? Deciding on it would repeat that op with
/// a stale resourceVersion (a 409) or attach and write the status twice.
pub fn cache_behind(cached: Option<&str>, written: &str) -> bool {
    stowage_common::informer::is_newer(Some(written), cached)
}

pub async fn run(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    tokio::join!(ctx.vas.ready(), ctx.pvs.ready());
    let mut vas_rx = ctx.vas.subscribe();
    let mut pvs_rx = ctx.pvs.subscribe();
    let (tx, mut rx) = mpsc::unbounded_channel::<Outcome>();
    let mut tracker = Tracker::default();
    let mut tasks = JoinSet::new();
    // VA name → resourceVersion our last op on it wrote, until the cache has caught up.
    let mut written: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut last_verify = Instant::now() - VERIFY_PERIOD;
    tracing::info!("attacher started");
    loop {
        let now = Instant::now();
        let verify = now.duration_since(last_verify) >= VERIFY_PERIOD;
        if verify {
            last_verify = now;
        }
        let mut wanted = std::collections::BTreeSet::new();
        for va in ctx.vas.store().state() {
            if !is_ours(&va, &ctx.node) {
                continue;
            }
            let key = OpKey::volume(&va.name_any());
            if let Some(rv) = written.get(&va.name_any()) {
                if cache_behind(va.metadata.resource_version.as_deref(), rv) {
                    wanted.insert(key);
                    continue;
                }
                written.remove(&va.name_any());
            }
            let device_ok = if verify && !tracker.is_running(&key) {
                device_ok(&ctx, &va).await
            } else {
                None
            };
            let Some(action) = decide(&va, &ctx.node, device_ok) else {
                continue;
            };
            wanted.insert(key.clone());
            if !tracker.can_start(&key, action.kind(), now) {
                continue;
            }
            tracker.start(key.clone());
            let owed = Owed::new(
                &tx,
                Outcome {
                    key: key.clone(),
                    kind: action.kind(),
                    wrote: None,
                },
            );
            let ctx = ctx.clone();
            tasks.spawn(async move {
                let wrote = execute(&ctx, &va, action).await;
                owed.pay(Outcome {
                    key,
                    kind: action.kind(),
                    wrote,
                });
            });
        }
        tracker.retain(|k| wanted.contains(k));
        let names: std::collections::HashSet<String> =
            ctx.vas.store().state().iter().map(|v| v.name_any()).collect();
        written.retain(|n, _| names.contains(n));
        ctx.metrics.passes.with_label_values(&["attacher"]).inc();
        let wake = tracker
            .next_expiry(now)
            .map_or(now + VERIFY_PERIOD, |t| t.min(now + VERIFY_PERIOD));
        tokio::select! {
            _ = vas_rx.recv() => {}
            _ = pvs_rx.recv() => {}
            Some(d) = rx.recv() => finish(&mut tracker, &mut written, d),
            _ = tokio::time::sleep_until(wake) => {}
            _ = stop.changed() => break,
        }
        while let Ok(d) = rx.try_recv() {
            finish(&mut tracker, &mut written, d);
        }
        crate::volumes::drain(&mut vas_rx);
        crate::volumes::drain(&mut pvs_rx);
    }
    let _ = tokio::time::timeout(Duration::from_secs(30), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
}

fn finish(tracker: &mut Tracker, written: &mut std::collections::HashMap<String, String>, d: Outcome) {
    tracker.finish(&d.key, d.kind, d.wrote.is_some(), Instant::now());
    if let (Some(rv), Some(name)) = (d.wrote, Some(d.key.volume.as_str())) {
        written.insert(name.to_string(), rv);
    }
}

/// The device an attachment reported before an Attach: only an attached VA with a device path is
/// attached again, and then only because that device stopped backing the image.
pub fn lost_device(va: &VolumeAttachment) -> Option<&str> {
    let st = va.status.as_ref().filter(|s| s.attached)?;
    st.attachment_metadata
        .as_ref()?
        .get("devicePath")
        .map(String::as_str)
}

/// For an attached VA: does the device in its status still back its image?
async fn device_ok(ctx: &Ctx, va: &VolumeAttachment) -> Option<bool> {
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
async fn execute(ctx: &Ctx, va: &VolumeAttachment, action: VaAction) -> Option<String> {
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
            crate::owed::test_hook(
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
                    ctx.events
                        .warning(&va.object_ref(&()), "FailedAttach", "Attach", msg.clone());
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
                    ctx.events
                        .warning(&va.object_ref(&()), "FailedDetach", "Detach", msg.clone());
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
    match tokio::fs::metadata(&image).await {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(format!("image {} is not a regular file", image.display())),
        Err(e) => return Err(format!("image file {} of volume {pv_name}: {e}", image.display())),
    }
    let existing = sys::loops_of(&image).await.map_err(|e| e.to_string())?;
    if let Some(dev) = existing.into_iter().next() {
        return Ok((dev, handle));
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
        let Some(devno) = sys::rdev(Path::new(dev)).await else {
            continue;
        };
        let users: Vec<String> = table
            .iter()
            .filter(|m| {
                m.devno == devno
                    || (m.fstype == "devtmpfs" && m.root == format!("/{}", dev.trim_start_matches("/dev/")))
            })
            .map(|m| m.mount_point.display().to_string())
            .chain(
                block_files
                    .iter()
                    .filter(|(_, d)| *d == devno)
                    .map(|(p, _)| p.clone()),
            )
            .collect();
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

/// Block device files published into pods: path → device numbers.
async fn block_files(pods: &Path) -> Vec<(String, mountinfo::DevNo)> {
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::storage::v1::{
        VolumeAttachmentSource, VolumeAttachmentSpec, VolumeAttachmentStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    use std::collections::BTreeMap;

    use super::*;

    fn va(node: &str, finalizer: bool, attached: bool, deleting: bool) -> VolumeAttachment {
        VolumeAttachment {
            metadata: ObjectMeta {
                name: Some("va".into()),
                finalizers: finalizer.then(|| vec![VA_FINALIZER.to_string()]),
                deletion_timestamp: deleting.then_some(Time(Timestamp::UNIX_EPOCH)),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: DRIVER.into(),
                node_name: node.into(),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some("pv".into()),
                    ..Default::default()
                },
            },
            status: attached.then(|| VolumeAttachmentStatus {
                attached: true,
                attachment_metadata: Some(BTreeMap::from([("devicePath".into(), "/dev/loop1".into())])),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn finalizer_first_then_attach_then_nothing() {
        assert_eq!(
            decide(&va("n", false, false, false), "n", None),
            Some(VaAction::AddFinalizer)
        );
        assert_eq!(
            decide(&va("n", true, false, false), "n", None),
            Some(VaAction::Attach)
        );
        assert_eq!(decide(&va("n", true, true, false), "n", None), None);
        assert_eq!(decide(&va("n", true, true, false), "n", Some(true)), None);
        // The device went away: attach again.
        assert_eq!(
            decide(&va("n", true, true, false), "n", Some(false)),
            Some(VaAction::Attach)
        );
    }

    #[test]
    fn only_a_reattach_reports_a_lost_device() {
        assert_eq!(lost_device(&va("n", true, true, false)), Some("/dev/loop1"));
        assert_eq!(lost_device(&va("n", true, false, false)), None);
        let mut no_path = va("n", true, true, false);
        no_path.status.as_mut().unwrap().attachment_metadata = None;
        assert_eq!(lost_device(&no_path), None);
    }

    #[test]
    fn a_cache_older_than_our_write_is_not_decided_on() {
        assert!(
            cache_behind(Some("10"), "11"),
            "our patch is not in the cache yet"
        );
        assert!(!cache_behind(Some("11"), "11"), "the cache shows our write");
        assert!(!cache_behind(Some("12"), "11"), "and anything after it");
        // Unknown versions never hold a decision back.
        assert!(!cache_behind(Some("10"), ""));
    }

    #[test]
    fn deletion_detaches_only_with_our_finalizer_and_only_our_node() {
        assert_eq!(
            decide(&va("n", true, true, true), "n", None),
            Some(VaAction::Detach)
        );
        assert_eq!(decide(&va("n", false, true, true), "n", None), None);
        // A VolumeAttachment from before the finalizer's rename is detached too.
        let mut legacy = va("n", false, true, true);
        legacy.metadata.finalizers = Some(vec!["loop.stowage.dev/attached".into()]);
        assert_eq!(decide(&legacy, "n", None), Some(VaAction::Detach));
        // ...and, while live, gets the current finalizer (which replaces the old one).
        legacy.metadata.deletion_timestamp = None;
        assert_eq!(decide(&legacy, "n", None), Some(VaAction::AddFinalizer));
        assert_eq!(VA_FINALIZER, "external-attacher/loop-stowage-dev");
        assert_eq!(decide(&va("other", true, true, false), "n", None), None);
        let mut foreign = va("n", true, false, false);
        foreign.spec.attacher = "csi.example.com".into();
        assert_eq!(decide(&foreign, "n", None), None);
    }
}

//! The operations: mount, teardown, device unmount and online expansion, each run as a task
//! of its own with what the pass that started it saw.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;

use super::*;
use crate::core::Op;
use crate::ctx::Ctx;
use crate::fsgroup;
use crate::mountinfo::{self, DevNo};
use crate::probe::Health;
use crate::state::{AttachStatus, DesiredVolume, Mounted, PodInfo};
use crate::sys;
use stowage_loopdriver::fence;

/// One operation with everything it needs from the pass that started it.
pub(crate) struct Executor {
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) dv: Option<DesiredVolume>,
    pub(crate) actual: crate::state::ActualVolume,
    pub(crate) pod: Option<PodInfo>,
}

/// A failed step: its name (as upstream words it) and what went wrong.
pub(crate) struct StepError {
    pub(crate) step: &'static str,
    pub(crate) message: String,
}

/// The live Node lists `unique` both as attached and as in use, or the mount must wait.
async fn verify_listed_attached(ctx: &Ctx, unique: &str) -> Result<(), StepError> {
    const STEP: &str = "VerifyControllerAttachedVolume";
    let node = kube::Api::<k8s_openapi::api::core::v1::Node>::all(ctx.client.clone())
        .get(&ctx.node)
        .await
        .map_err(step(STEP))?;
    let attached = super::ingest::volumes_attached(&node).contains(unique);
    let in_use = node
        .status
        .iter()
        .flat_map(|s| s.volumes_in_use.iter().flatten())
        .any(|v| v == unique);
    match (attached, in_use) {
        (true, true) => Ok(()),
        (false, _) => Err(StepError {
            step: STEP,
            message: format!(
                "volume {unique} is not attached according to the node status (volumesAttached)"
            ),
        }),
        (true, false) => Err(StepError {
            step: STEP,
            message: format!("volume {unique} is not yet listed in the node status as in use (volumesInUse)"),
        }),
    }
}

pub(crate) fn step<E: std::fmt::Display>(step: &'static str) -> impl FnOnce(E) -> StepError {
    move |e| StepError {
        step,
        message: e.to_string(),
    }
}

impl Executor {
    pub(crate) async fn run(self, op: Op) -> Outcome {
        let mut expanded = None;
        let result = match &op {
            Op::Mount {
                uid, mount_device, ..
            } => match self.mount(uid, *mount_device).await {
                Ok(done) => {
                    expanded = done;
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Op::Teardown { uid, block, .. } => self.teardown(op.pv(), uid, *block).await,
            Op::UnmountDevice { pv } => self.unmount_device(pv).await,
            Op::Expand { .. } => match self.expand().await {
                Ok(done) => {
                    expanded = done;
                    Ok(())
                }
                Err(e) => Err(e),
            },
        };
        let ok = result.is_ok();
        if let Err(e) = &result {
            tracing::warn!(op = op.kind(), pv = op.pv(), step = e.step, error = %e.message, "operation failed");
        }
        Outcome { op, ok, expanded }
    }

    fn pod_event(&self, warning: bool, reason: &str, note: String) {
        let Some(pod) = &self.pod else { return };
        if warning {
            self.ctx.events.warning(&pod.reference(), reason, "Mount", note);
        } else {
            self.ctx.events.normal(&pod.reference(), reason, "Mount", note);
        }
    }

    /// Mounts; returns the claim whose expansion it finished on the way, if any.
    async fn mount(&self, uid: &str, mount_device: bool) -> Result<Option<(String, String)>, StepError> {
        let Some(dv) = &self.dv else { return Ok(None) };
        let Some(usage) = dv.pods.get(uid) else {
            return Ok(None);
        };
        crate::panic_hook::test_hook("mount", &dv.pv);
        let result = self.mount_inner(dv, uid, mount_device).await;
        match &result {
            Ok(_) => {
                let gid = dv
                    .gid
                    .map(|g| format!(" (supplemental group {g} from pv.beta.kubernetes.io/gid)"))
                    .unwrap_or_default();
                let note = format!("MountVolume.SetUp succeeded for volume \"{}\"{gid}", dv.pv);
                tracing::info!(pod = %usage.pod.name, pv = %dv.pv, "volume mounted");
                if let Some(created) = usage.pod.created {
                    let secs = Timestamp::now().duration_since(created).as_secs_f64().max(0.0);
                    self.ctx.metrics.pod_volume_ready.observe(secs);
                }
                self.pod_event(false, "SuccessfulMountVolume", note);
            }
            Err(e) => {
                let note = format!(
                    "MountVolume.{} failed for volume \"{}\": {}",
                    e.step, dv.pv, e.message
                );
                self.pod_event(true, "FailedMount", note);
            }
        }
        let grew = result?;
        if !grew {
            return Ok(None);
        }
        // Grown offline before the mount: finish the claim as an online expansion would.
        let size = dv.resize_to.clone().unwrap_or_default();
        let r = finish_claim_resize(&self.ctx, &dv.claim.namespace, &dv.claim.name, &size).await;
        let r = r.map_err(|e| StepError {
            step: "NodeExpandVolume",
            message: e.to_string(),
        });
        self.resize_events(dv, r.as_ref().err());
        Ok(Some((dv.claim.uid.clone(), r?)))
    }

    /// Returns whether the file system was grown before it was mounted.
    async fn mount_inner(
        &self,
        dv: &DesiredVolume,
        uid: &str,
        mount_device: bool,
    ) -> Result<bool, StepError> {
        let ctx = &self.ctx;
        let usage = &dv.pods[uid];
        let AttachStatus::Attached { device } = &dv.attachment else {
            return Err(StepError {
                step: "WaitForAttach",
                message: "volume is not attached".into(),
            });
        };
        // Nothing of this volume in place here yet: ask the live Node, as a kubelet does
        // (verifyControllerAttachedVolume). This read comes after our volumesInUse write, so either
        // the controller saw the volume in use and will not detach it, or its removal from
        // volumesAttached (made before any detach) is visible here and nothing is mounted.
        let in_place = self.actual.device.as_ref().is_some_and(Mounted::ok)
            || self.actual.pods.values().any(|p| p.state.ok());
        if !in_place {
            verify_listed_attached(ctx, &dv.unique_name()).await?;
        }
        let image = ctx.images.path(&dv.handle).ok().ok_or_else(|| StepError {
            step: "WaitForAttach",
            message: format!("volume handle {:?} is not a plain file name", dv.handle),
        })?;
        // The device named by the attachment must still be this volume's: a stale path could
        // point at a freed (or reused) loop device.
        if !sys::backs(device, &image).await {
            return Err(StepError {
                step: "WaitForAttach",
                message: format!(
                    "device {device} is not backed by {} any more; waiting for the attachment to be renewed",
                    image.display()
                ),
            });
        }
        let devno = sys::rdev(Path::new(device)).await.ok_or_else(|| StepError {
            step: "WaitForAttach",
            message: format!("{device} is not a block device"),
        })?;
        // A volume no node may write to (csi.readOnly, or ReadOnlyMany only), or a device the
        // kernel holds read-only, is mounted read-only everywhere and never formatted.
        let device_ro = sys::device_read_only(devno).await;
        let read_only = dv.pv_read_only || device_ro == Some(true);
        let may_format = !read_only && device_ro == Some(false);
        let layout = &ctx.layout;
        if dv.block {
            let started = std::time::Instant::now();
            let r = self
                .publish_block(&layout.pod_device(uid, &dv.pv), devno, usage.fs_group)
                .await;
            ctx.metrics.record("setup", started, r.is_ok());
            return r.map(|()| false);
        }
        let global = layout.global_mount(&dv.pv);
        let mut grew = false;
        if mount_device {
            let started = std::time::Instant::now();
            let grow = dv.resize_to.is_some() && !read_only;
            if grow && let Some(size) = &dv.resize_to {
                grow_local_image(ctx, &dv.handle, size)
                    .await
                    .map_err(step("NodeExpandVolume"))?;
            }
            let lazy = self.actual.device.as_ref().is_some_and(Mounted::broken);
            let r = mount_global(
                device,
                devno,
                &global,
                MountMode {
                    fs_type: dv.fs_type.clone(),
                    local: ctx.store_mode.is_local(),
                    read_only,
                    may_format,
                    grow,
                    lazy,
                    image: image.clone(),
                    repair_record: layout.repair_record(&dv.pv),
                },
            )
            .await;
            ctx.metrics.record("mount_device", started, r.is_ok());
            grew = r?;
        }
        let started = std::time::Instant::now();
        let r = self
            .setup(
                &global,
                &layout.pod_mount(uid, &dv.pv),
                devno,
                usage.read_only || read_only,
                usage,
            )
            .await;
        ctx.metrics.record("setup", started, r.is_ok());
        r.map(|()| grew)
    }

    async fn publish_block(&self, path: &Path, devno: DevNo, fs_group: Option<u32>) -> Result<(), StepError> {
        let parent = path.parent().unwrap_or(path);
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(step("MapVolume.SetUpDevice"))?;
        let current = tokio::fs::symlink_metadata(path)
            .await
            .ok()
            .filter(|m| m.file_type().is_block_device())
            .map(|m| mountinfo::split_dev(m.rdev()));
        if current != Some(devno) {
            sys::mknod_block(path, devno)
                .await
                .map_err(step("MapVolume.MapPodDevice"))?;
        }
        if let Some(gid) = fs_group {
            std::os::unix::fs::lchown(path, None, Some(gid)).map_err(step("MapVolume.MapPodDevice"))?;
        }
        Ok(())
    }

    async fn setup(
        &self,
        global: &Path,
        target: &Path,
        devno: DevNo,
        read_only: bool,
        usage: &crate::state::PodUse,
    ) -> Result<(), StepError> {
        let s = "SetUp";
        tokio::fs::create_dir_all(target).await.map_err(step(s))?;
        let existing = sys::mounts_at(target).await.map_err(step(s))?;
        if let Some(top) = existing.last() {
            if top.devno == devno
                && sys::stat_dev(target).await == Some(devno)
                && top.read_only() == read_only
            {
                return Ok(());
            }
            // Broken, foreign or with the wrong mode: replace it (a plain unmount; a broken one
            // was torn down, lazily if need be, before this mount was started).
            sys::unmount(target, false).await.map_err(step(s))?;
        }
        // The device mount must be there and be this device; never bind an empty directory.
        if sys::stat_dev(global).await != Some(devno) {
            return Err(StepError {
                step: s,
                message: format!("device is not mounted at {}", global.display()),
            });
        }
        sys::bind_mount(global, target, read_only)
            .await
            .map_err(step(s))?;
        if let (Some(gid), false) = (usage.fs_group, read_only) {
            let started = std::time::Instant::now();
            let path = target.to_path_buf();
            let on_mismatch = usage.fs_group_on_root_mismatch;
            let r = tokio::task::spawn_blocking(move || fsgroup::apply(&path, gid, on_mismatch))
                .await
                .map_err(step(s))?;
            tracing::debug!(took = ?started.elapsed(), gid, "fsGroup applied");
            r.map_err(|e| StepError {
                step: s,
                message: format!("applying fsGroup {gid}: {e}"),
            })?;
        }
        Ok(())
    }

    async fn teardown(&self, pv: &str, uid: &str, block: bool) -> Result<(), StepError> {
        let ctx = &self.ctx;
        let started = std::time::Instant::now();
        let r = self.teardown_inner(pv, uid, block).await;
        ctx.metrics.record("teardown", started, r.is_ok());
        match &r {
            Ok(()) if still_wanted(self.dv.as_ref(), uid) => {
                // Only a broken mount is torn down under a pod that still wants it: tell the
                // user, who may have seen I/O errors, that it is being mounted again.
                let why = match self.actual.pods.get(uid).map(|p| &p.state.health) {
                    Some(Health::Broken(why)) => why.clone(),
                    _ => "failed its health check".into(),
                };
                let note =
                    format!("the mount of volume \"{pv}\" is broken ({why}); unmounted, mounting it again");
                tracing::warn!(pv, pod_uid = uid, "{note}");
                self.pod_event(true, "VolumeMountBroken", note);
            }
            Ok(()) => tracing::info!(pv, pod_uid = uid, "pod volume unmounted"),
            Err(e) => {
                let note = format!(
                    "UnmountVolume.{} failed for volume \"{pv}\" (pod {uid}): {}",
                    e.step, e.message
                );
                self.pod_event(true, "FailedUnmount", note);
            }
        }
        r
    }

    async fn teardown_inner(&self, pv: &str, uid: &str, block: bool) -> Result<(), StepError> {
        let layout = &self.ctx.layout;
        let pod_dir = layout.pods_dir().join(uid);
        let mut dirs = vec![];
        if block {
            let s = "UnmapDevice";
            let path = layout.pod_device(uid, pv);
            // Only remove what we made: a device node or nothing.
            if let Ok(m) = tokio::fs::symlink_metadata(&path).await {
                if m.is_dir() {
                    sys::remove_dir_if_empty(&path).await.map_err(step(s))?;
                } else {
                    tokio::fs::remove_file(&path).await.map_err(step(s))?;
                }
            }
            dirs.push(path.parent().map(Path::to_path_buf).unwrap_or_default());
            dirs.push(pod_dir.join("volumeDevices"));
        } else {
            let s = "TearDown";
            let target = layout.pod_mount(uid, pv);
            // Lazily only when judged broken: a healthy or slow mount that refuses (busy) is
            // reported and retried, never detached from under its users.
            let lazy = self.actual.pods.get(uid).is_some_and(|p| p.state.broken());
            sys::unmount(&target, lazy).await.map_err(step(s))?;
            // Anything left in the directory was written while nothing was mounted: keep it
            // and say so rather than delete data.
            match tokio::fs::remove_dir(&target).await {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(StepError {
                        step: s,
                        message: format!("cannot remove {}: {e}", target.display()),
                    });
                }
            }
            let vol_dir = layout.pod_volume_dir(uid, pv);
            dirs.push(vol_dir.clone());
            dirs.push(vol_dir.parent().map(Path::to_path_buf).unwrap_or_default());
            dirs.push(pod_dir.join("volumes"));
        }
        dirs.push(pod_dir);
        for d in dirs {
            sys::remove_dir_if_empty(&d).await.map_err(step("TearDown"))?;
        }
        Ok(())
    }

    async fn unmount_device(&self, pv: &str) -> Result<(), StepError> {
        let started = std::time::Instant::now();
        let r = self.unmount_device_inner(pv).await;
        self.ctx.metrics.record("unmount_device", started, r.is_ok());
        if r.is_ok() {
            tracing::info!(pv, "device unmounted");
        }
        r
    }

    async fn unmount_device_inner(&self, pv: &str) -> Result<(), StepError> {
        let s = "UnmountDevice";
        let global = self.ctx.layout.global_mount(pv);
        let table = mountinfo::read().await.map_err(step(s))?;
        if let Some(top) = table.iter().rev().find(|m| m.mount_point == global) {
            // Refuse while the file system is still mounted elsewhere (a bind mount we do not
            // know about would lose its device under it).
            let others: Vec<_> = table
                .iter()
                .filter(|m| m.devno == top.devno && m.mount_point != global && m.fstype == top.fstype)
                .map(|m| m.mount_point.display().to_string())
                .collect();
            if !others.is_empty() {
                return Err(StepError {
                    step: s,
                    message: format!("device {} is still mounted at {}", top.source, others.join(", ")),
                });
            }
        }
        let lazy = self.actual.device.as_ref().is_some_and(Mounted::broken);
        sys::unmount(&global, lazy).await.map_err(step(s))?;
        match tokio::fs::remove_dir(&global).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StepError {
                step: s,
                message: format!("cannot remove {}: {e}", global.display()),
            }),
        }
    }

    /// Online expansion; returns the claim (uid, resourceVersion) it finished.
    async fn expand(&self) -> Result<Option<(String, String)>, StepError> {
        let Some(dv) = &self.dv else { return Ok(None) };
        let started = std::time::Instant::now();
        let r = self.expand_inner(dv).await;
        self.ctx.metrics.record("expand_fs", started, r.is_ok());
        self.resize_events(dv, r.as_ref().err());
        r
    }

    /// FileSystemResizeSuccessful / FileSystemResizeFailed on the claim and its pods here.
    fn resize_events(&self, dv: &DesiredVolume, err: Option<&StepError>) {
        let pv = &dv.pv;
        let claim_ref = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("PersistentVolumeClaim".into()),
            namespace: Some(dv.claim.namespace.clone()),
            name: Some(dv.claim.name.clone()),
            uid: Some(dv.claim.uid.clone()),
            ..Default::default()
        };
        let (warning, reason, note) = match err {
            None => (
                false,
                "FileSystemResizeSuccessful",
                format!("MountVolume.NodeExpandVolume succeeded for volume \"{pv}\""),
            ),
            Some(e) => (
                true,
                "FileSystemResizeFailed",
                format!(
                    "MountVolume.NodeExpandVolume failed for volume \"{pv}\": {}",
                    e.message
                ),
            ),
        };
        let ev = &self.ctx.events;
        for obj in std::iter::once(claim_ref).chain(dv.pods.values().map(|u| u.pod.reference())) {
            if warning {
                ev.warning(&obj, reason, "Resize", note.clone());
            } else {
                ev.normal(&obj, reason, "Resize", note.clone());
            }
        }
    }

    async fn expand_inner(&self, dv: &DesiredVolume) -> Result<Option<(String, String)>, StepError> {
        let s = "NodeExpandVolume";
        let Some(new_size) = &dv.resize_to else {
            return Ok(None);
        };
        let AttachStatus::Attached { device } = &dv.attachment else {
            return Err(StepError {
                step: s,
                message: "volume is not attached".into(),
            });
        };
        if !dv.block {
            let dev = self.actual.device.as_ref();
            if dev.is_some_and(|d| d.read_only) {
                return Err(StepError {
                    step: s,
                    message: "the volume is mounted read-only, its file system cannot be grown".into(),
                });
            }
        }
        grow_local_image(&self.ctx, &dv.handle, new_size)
            .await
            .map_err(step(s))?;
        sys::loop_refresh(device).await.map_err(step(s))?;
        let xfs = !dv.block
            && matches!(sys::probe(device).await, Ok(sys::Probe::Found(t)) if t == stowage_loopdriver::csi::caps::XFS);
        if xfs {
            // XFS grows through its mount point.
            let global = self.ctx.layout.global_mount(&dv.pv);
            sys::xfs_growfs(&global).await.map_err(step(s))?;
        } else if !dv.block
            && let Err(e) = sys::resize2fs(device).await
        {
            let mut message = e.to_string();
            if message.contains("Permission denied") {
                // Online ext4 growth needs CAP_SYS_RESOURCE; without it the offline path on the
                // next device mount still works.
                message.push_str(
                    "; online resize is not permitted here (CAP_SYS_RESOURCE missing), \
                     the file system grows when the volume is next mounted on a node",
                );
            }
            return Err(StepError { step: s, message });
        }
        let rv = finish_claim_resize(&self.ctx, &dv.claim.namespace, &dv.claim.name, new_size)
            .await
            .map_err(step(s))?;
        tracing::info!(pv = %dv.pv, size = %new_size, "file system expanded");
        Ok(Some((dv.claim.uid.clone(), rv)))
    }
}

/// Does a live pod still want this volume (so a teardown of it is a repair, not a goodbye)?
pub(crate) fn still_wanted(dv: Option<&DesiredVolume>, uid: &str) -> bool {
    dv.is_some_and(|dv| dv.pods.contains_key(uid))
}

/// How `mount_global` may treat the device.
pub(crate) struct MountMode {
    /// The file system to make on a blank device (ext4, or XFS on a node-local store).
    pub(crate) fs_type: String,
    /// The store is this node's own (XFS may be mounted read-write: the volume never moves).
    pub(crate) local: bool,
    /// Mount read-only.
    pub(crate) read_only: bool,
    /// A blank device may be formatted: the volume and the device are writable.
    pub(crate) may_format: bool,
    /// Grow an existing ext file system to the device's size first (offline expansion).
    pub(crate) grow: bool,
    /// A mount already there was judged broken: it may be detached lazily.
    pub(crate) lazy: bool,
    /// The volume's image (multi-mount protection looks for other loop devices of it).
    pub(crate) image: PathBuf,
    /// This node's record of an offline repair of the volume while it runs (`fence::repair`).
    pub(crate) repair_record: PathBuf,
}

/// Mounts the device at the global path, formatting it first only when it holds nothing at all
/// and may be written. With `grow`, an existing ext file system is grown to the device's size
/// before the mount (the offline path, for volumes whose online expansion could not run).
/// Returns whether it grew.
pub(crate) async fn mount_global(
    device: &str,
    devno: DevNo,
    global: &Path,
    mode: MountMode,
) -> Result<bool, StepError> {
    let s = "MountDevice";
    let read_only = mode.read_only;
    tokio::fs::create_dir_all(global).await.map_err(step(s))?;
    let existing = sys::mounts_at(global).await.map_err(step(s))?;
    if let Some(top) = existing.last() {
        if top.devno == devno && sys::stat_dev(global).await == Some(devno) && (top.read_only() || !read_only)
        {
            return Ok(false);
        }
        // A stale or foreign mount (or a writable one of a read-only volume) sits there; clear
        // it first.
        sys::unmount(global, mode.lazy).await.map_err(step(s))?;
    }
    use stowage_loopdriver::csi::caps;
    let found = match sys::probe(device).await.map_err(step(s))? {
        sys::Probe::Blank if !mode.may_format => {
            return Err(StepError {
                step: s,
                message: format!(
                    "{device} holds no file system and the volume is read-only (csi.readOnly, ReadOnlyMany access or a read-only device); \
                     it is never formatted here: write a file system to the image first"
                ),
            });
        }
        sys::Probe::Blank => {
            let fs = caps::fs_type(&mode.fs_type).map_err(|why| StepError {
                step: s,
                message: format!("{device} is not formatted: {why}"),
            })?;
            tracing::info!(device, fs, "no file system found, formatting");
            sys::mkfs(fs, device).await.map_err(step(s))?;
            fs.to_string()
        }
        sys::Probe::Found(kind) => {
            tracing::debug!(device, kind, "file system found, not formatting");
            kind
        }
    };
    let ext = found.starts_with("ext");
    let xfs = found == caps::XFS;
    if xfs
        && !read_only
        && !mode.local
        && let Some(why) = caps::shared_refusal(&found)
    {
        return Err(StepError {
            step: s,
            message: format!("{device} is not mounted read-write: {why}"),
        });
    }
    // Multi-mount protection before a read-write mount, and before an offline repair (which
    // would otherwise wait on a "fsck" number its own stopped predecessor left). A read-only
    // mount never touches it.
    let ready = if read_only || !ext {
        fence::Ready::Mount
    } else {
        fence::ready_for_write(device, &mode.image, &mode.repair_record)
            .await
            .map_err(step(s))?
    };
    if (mode.grow || ready == fence::Ready::RepairFirst) && !read_only && ext {
        let s = "NodeExpandVolume";
        sys::loop_refresh(device).await.map_err(step(s))?;
        fence::repair("e2fsck", "resize2fs", device, &mode.repair_record)
            .await
            .map_err(|(_, e)| step(s)(e))?;
        tracing::info!(device, "file system checked and grown before mounting");
        sys::mount_device(device, global, read_only)
            .await
            .map_err(step("MountDevice"))?;
        return Ok(mode.grow);
    }
    sys::mount_device(device, global, read_only)
        .await
        .map_err(step(s))?;
    if xfs && !read_only {
        // XFS grows only while mounted: take up an image grown while it was not (a no-op when
        // the sizes match).
        let s = "NodeExpandVolume";
        sys::loop_refresh(device).await.map_err(step(s))?;
        sys::xfs_growfs(global).await.map_err(step(s))?;
        return Ok(mode.grow);
    }
    Ok(false)
}

/// Local mode: the image is this node's alone, so the node grows it to the claim's new size
/// before the device is refreshed (the controller only recorded the size). A no-op in shared
/// mode, where the controller grew it; never shrinks, never creates.
async fn grow_local_image(ctx: &Ctx, handle: &str, size: &str) -> Result<(), String> {
    if !ctx.store_mode.is_local() {
        return Ok(());
    }
    let bytes = stowage_common::store::quantity::bytes(size)
        .and_then(|b| u64::try_from(b).ok())
        .ok_or_else(|| format!("cannot read size {size:?}"))?;
    let (store, h) = (ctx.images.clone(), handle.to_string());
    tokio::task::spawn_blocking(move || store.grow(&h, bytes))
        .await
        .map_err(|e| e.to_string())?
        .map(|_| ())
        .map_err(|e| e.to_string())
}

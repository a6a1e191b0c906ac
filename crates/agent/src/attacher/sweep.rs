//! Loop devices of the image store that no attachment accounts for any more, released.
//!
//! A device outlives its VolumeAttachment when the controller released the attachment of a node
//! it took for dead (the out-of-service taint: no detach ran here) and the node came back without
//! a reboot, or when an agent was stopped between attaching a device and recording it. Nothing
//! else would ever free such a device: it holds its image open (a deleted image keeps its space)
//! and takes a loop slot. The sweep frees a device of this store only when, at two looks at least
//! the grace period apart, nothing mounts it, no pod of this node has it as a block file, nothing
//! holds it open exclusively, and no VolumeAttachment of any node names it, so an attach that has not yet recorded its device (its
//! status write held up by a slow API) is left alone.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::time::Instant;

use super::exec::{block_files, users};
use crate::ctx::Ctx;
use crate::{mountinfo, sys};
use stowage_loopdriver::fence;

/// How often the sweep looks at most.
const PERIOD: Duration = Duration::from_secs(30);

/// Devices seen unaccounted for: device → (its backing file then, first seen).
pub(super) struct Sweep {
    /// How long a device must stay unaccounted for before it is released (`--stale-device-grace-seconds`).
    grace: Duration,
    suspects: HashMap<String, (String, Instant)>,
}

/// What a look decides for one loop device of the store.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Something uses or names it (or it changed): forget it.
    Accounted,
    /// Unaccounted for, not long enough yet.
    Suspect,
    /// Unaccounted for at two looks the grace period apart: release it.
    Release,
}

/// The pure rule: `used` (mounted, a block file, or named by an attachment) and the earlier look.
pub(super) fn judge(
    used: bool,
    backing: &str,
    earlier: Option<&(String, Instant)>,
    now: Instant,
    grace: Duration,
) -> Verdict {
    if used {
        return Verdict::Accounted;
    }
    match earlier {
        Some((b, since)) if b == backing && now.duration_since(*since) >= grace => Verdict::Release,
        _ => Verdict::Suspect,
    }
}

impl Sweep {
    pub(super) fn new(grace: Duration) -> Self {
        Self {
            grace,
            suspects: HashMap::new(),
        }
    }

    /// Looks are at least twice per grace period, so a device goes within 1.5 of it.
    pub(super) fn period(&self) -> Duration {
        PERIOD.min(self.grace / 2)
    }

    /// One look; `busy`: an attach or detach of this node is running, so nothing is released
    /// in this look (the next one decides).
    pub(super) async fn look(&mut self, ctx: &Ctx, busy: bool) {
        let devices = store_devices(ctx).await;
        let Ok(table) = mountinfo::read().await else {
            return;
        };
        let blocks = block_files(&ctx.layout.pods_dir()).await;
        let named: HashSet<String> = ctx
            .vas
            .store()
            .state()
            .iter()
            .filter_map(|va| {
                va.status
                    .as_ref()?
                    .attachment_metadata
                    .as_ref()?
                    .get("devicePath")
                    .cloned()
            })
            .collect();
        let now = Instant::now();
        let mut still = HashMap::new();
        for (dev, backing) in devices {
            // Last, held at all (an exclusive open fails): mounted in a mount namespace this
            // table does not show (another node's where one kernel plays several), or open by a
            // repair tool. The same test keeps the attacher from adopting such a device.
            let used = named.contains(&dev)
                || users(&dev, &table, &blocks).await.is_none_or(|u| !u.is_empty())
                || fence::held_here(&dev).await;
            let earlier = self.suspects.get(&dev);
            match judge(used, &backing, earlier, now, self.grace) {
                Verdict::Accounted => {}
                Verdict::Suspect => {
                    let first = match earlier {
                        Some((b, since)) if *b == backing => *since,
                        _ => now,
                    };
                    still.insert(dev, (backing, first));
                }
                Verdict::Release if busy => {
                    still.insert(dev, earlier.cloned().unwrap_or((backing, now)));
                }
                Verdict::Release => release(ctx, &dev, &backing, self.grace).await,
            }
        }
        self.suspects = still;
    }
}

async fn release(ctx: &Ctx, dev: &str, backing: &str, grace: Duration) {
    match sys::loop_detach(dev).await {
        Ok(()) => {
            ctx.metrics.stale_devices_released.inc();
            tracing::warn!(device = dev, backing, grace = ?grace, "released a loop device of the image store that no attachment, mount or pod used");
            let node = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(ctx.node.clone()),
                ..Default::default()
            };
            ctx.events.normal(
                &node,
                "StaleLoopDeviceReleased",
                "Detach",
                format!(
                    "loop device {dev} of {backing} was used by no VolumeAttachment, mount or pod for {}s (an attachment released while this node was out of service, or an attach never recorded); released",
                    grace.as_secs()
                ),
            );
        }
        Err(e) => {
            tracing::warn!(device = dev, backing, error = %e, "cannot release a stale loop device; next look retries")
        }
    }
}

/// Loop devices backed by an image of this store (deleted ones too): device → backing file as
/// the kernel prints it.
async fn store_devices(ctx: &Ctx) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(mut rd) = tokio::fs::read_dir("/sys/block").await else {
        return out;
    };
    while let Ok(Some(e)) = rd.next_entry().await {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let dev = format!("/dev/{name}");
        let Some(backing) = sys::backing_file(&dev).await else {
            continue;
        };
        if of_store(ctx, &dev, &backing).await {
            out.push((dev, backing));
        }
    }
    out
}

/// Is `backing` (the kernel's text) an image of this store? By its directory when the kernel
/// prints the store's own path (a deleted image then too); else, since a device attached from
/// another mount namespace shows another path, by the file it is backed by (a live image only).
async fn of_store(ctx: &Ctx, dev: &str, backing: &str) -> bool {
    let path = Path::new(backing.trim_end_matches(" (deleted)"));
    let Some(handle) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".img"))
    else {
        return false;
    };
    let Ok(image) = ctx.images.path(handle) else {
        return false;
    };
    if path.parent() == Some(ctx.images.dir()) {
        return true;
    }
    sys::backs(dev, &image).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_two_looks_grace_apart_at_the_same_file_release() {
        let (t0, g) = (Instant::now(), Duration::from_secs(120));
        let seen = ("/s/a.img".to_string(), t0);
        assert_eq!(judge(false, "/s/a.img", None, t0, g), Verdict::Suspect);
        assert_eq!(
            judge(false, "/s/a.img", Some(&seen), t0 + g / 2, g),
            Verdict::Suspect
        );
        assert_eq!(judge(false, "/s/a.img", Some(&seen), t0 + g, g), Verdict::Release);
        // The device was freed and taken by another image meanwhile: a new suspect.
        assert_eq!(judge(false, "/s/b.img", Some(&seen), t0 + g, g), Verdict::Suspect);
        // Used (mounted, a block file, named by an attachment): never released.
        assert_eq!(
            judge(true, "/s/a.img", Some(&seen), t0 + g * 10, g),
            Verdict::Accounted
        );
    }
}

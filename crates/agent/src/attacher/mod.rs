//! The attacher: what external-attacher does for a CSI driver, done on the node for the loop
//! driver. A VolumeAttachment of this node gets our finalizer first, then its image is attached to
//! a loop device and the status says where; on deletion the device is released (once nothing
//! mounts it) and the finalizer dropped. The loop and its pure `decide` are here; the device steps
//! and API writes of one operation in `exec.rs`.
//!
//! Each operation runs as a task of its own and reports an `Outcome`, through `stowage_common::runtime::owed::Owed`, so a
//! task that panics still reports a failure and its attachment is retried. Its own task set and
//! `Tracker` rather than the shared queue and window: every wake re-decides all of this node's
//! attachments in one pass (with a device check every `VERIFY_PERIOD` that no watch event
//! triggers), and a failure backs off only the same kind of operation (a failed attach does not
//! delay the detach of a deleted attachment). Every `sweep::PERIOD` a look at the store's loop
//! devices releases those no attachment has accounted for since the look before (`sweep.rs`).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::ResourceExt;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::ctx::{Ctx, is_ours};
use crate::paths::VA_FINALIZER;
use crate::tracker::{OpKey, Tracker};
use exec::{device_ok, execute};
use stowage_common::runtime::driver::Inputs;
use stowage_common::runtime::owed::{Owed, Work};

use crate::passes::{self, Woke};
use stowage_common::vocab::annotations::is_loop_attacher_finalizer;

mod exec;
mod sweep;

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

/// One operation per task: its report settles its one debt.
impl Work for Outcome {
    fn same_work(&self, _: &Self) -> bool {
        true
    }
}

/// Is the cached VA older than what our last op wrote? Deciding on it would repeat that op with
/// a stale resourceVersion (a 409) or attach and write the status twice.
pub fn cache_behind(cached: Option<&str>, written: &str) -> bool {
    stowage_common::store::informer::is_newer(Some(written), cached)
}

/// `stale_grace`: how long the sweep waits before releasing an unaccounted device (`sweep.rs`).
pub async fn run(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>, stale_grace: Duration) {
    tokio::join!(ctx.vas.ready(), ctx.pvs.ready());
    let mut inputs = Inputs::new()
        .feed(ctx.vas.feed(), |_| ())
        .feed(ctx.pvs.feed(), |_| ());
    let (tx, mut rx) = mpsc::unbounded_channel::<Outcome>();
    let mut tracker = Tracker::default();
    let mut tasks = JoinSet::new();
    // VA name → resourceVersion our last op on it wrote, until the cache has caught up.
    let mut written: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut last_verify = Instant::now() - VERIFY_PERIOD;
    let mut sweep = sweep::Sweep::new(stale_grace);
    let mut last_sweep = Instant::now();
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
                vec![Outcome {
                    key: key.clone(),
                    kind: action.kind(),
                    wrote: None,
                }],
            );
            let ctx = ctx.clone();
            tasks.spawn(async move {
                let _guard = owed.guard();
                let wrote = execute(&ctx, &va, action).await;
                owed.send(Outcome {
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
        if now.duration_since(last_sweep) >= sweep.period() {
            last_sweep = now;
            sweep.look(&ctx, tracker.running() > 0).await;
        }
        let wake = tracker
            .next_expiry(now)
            .map_or(now + VERIFY_PERIOD, |t| t.min(now + VERIFY_PERIOD));
        // The next pass reads the stores whatever changed; a feed that ended stops the loop.
        let fold = |d| finish(&mut tracker, &mut written, d);
        match passes::wait(
            &mut inputs,
            &mut rx,
            fold,
            std::future::pending(),
            wake,
            &mut stop,
        )
        .await
        {
            Ok(Woke::Look) => {}
            Ok(Woke::Stop) => break,
            Err(e) => {
                tracing::error!(error = %e, "attacher stops");
                break;
            }
        }
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::storage::v1::{
        VolumeAttachmentSource, VolumeAttachmentSpec, VolumeAttachmentStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;

    use std::collections::BTreeMap;

    use super::*;
    use crate::paths::DRIVER;
    use k8s_openapi::jiff::Timestamp;

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

//! The image store's marker, checked every `RECHECK` (`ImageStore::ready_now`): the gauge
//! `stowage_agent_image_store_ready`, and Events on the Node when the store stops or starts being
//! ready, so a node where the shared file system is not mounted says so where `kubectl describe
//! node` shows it. Attaches check the marker themselves (`attacher::exec`); this loop only reports.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::sync::watch;

use crate::ctx::Ctx;

/// Event reasons on the Node.
pub const NOT_READY: &str = "ImageStoreNotReady";
pub const READY: &str = "ImageStoreReady";

/// A check that has not answered by then (a hung network file system) counts as not ready; the
/// next starts only once it returns, so hung reads never pile up.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn run(ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(stowage_loopdriver::image::RECHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let node = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(ctx.node.clone()),
        // As the kubelet's Node events: `kubectl describe node` looks them up by this UID.
        uid: Some(ctx.node.clone()),
        ..Default::default()
    };
    // None until the first answer: the first "not ready" is reported, a first "ready" is not.
    let mut last: Option<bool> = None;
    let mut pending: Option<tokio::task::JoinHandle<Result<(), String>>> = None;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tick.tick() => {}
        }
        let mut check = match pending.take() {
            Some(h) => h,
            None => {
                let store = ctx.images.clone();
                tokio::task::spawn_blocking(move || store.ready_now().map(|_| ()).map_err(|e| e.to_string()))
            }
        };
        let r = match tokio::time::timeout(CHECK_TIMEOUT, &mut check).await {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => Err(format!("the check failed: {e}")),
            Err(_) => {
                pending = Some(check);
                Err(format!(
                    "image store {} did not answer within {CHECK_TIMEOUT:?}",
                    ctx.images.dir().display()
                ))
            }
        };
        ctx.metrics.image_store_ready.set(i64::from(r.is_ok()));
        let now = r.is_ok();
        if last == Some(now) {
            continue;
        }
        match r {
            Err(e) => {
                tracing::warn!(error = %e, "image store not ready: no volume is attached on this node until it is");
                let note = format!("{e}; no volume of loop.stowage.dev is attached on this node until it is");
                ctx.events.warning(&node, NOT_READY, "CheckImageStore", note);
            }
            Ok(()) if last.is_some() => {
                tracing::info!(dir = %ctx.images.dir().display(), "image store ready again");
                let note = format!("image store {} has its marker again", ctx.images.dir().display());
                ctx.events.normal(&node, READY, "CheckImageStore", note);
            }
            Ok(()) => {}
        }
        last = Some(now);
    }
}

//! The image store's marker on a node: without it the agent attaches nothing (the directory may
//! be the empty mount point of a shared file system not mounted here) and says so on the Node,
//! the VolumeAttachment and its gauge; once the marker is back the volume attaches and mounts.

use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Api;
use stowage_loopdriver::image::MARKER;
use stowage_testkit::eventually;

use crate::env::*;

#[tokio::test]
async fn an_unmarked_store_attaches_nothing_and_says_so_on_the_node() {
    let (e, _guard) = env("store").await;
    let marker = e.images.join(MARKER);
    let saved = std::fs::read(&marker).unwrap();
    std::fs::remove_file(&marker).unwrap();
    let node = unique("node-s");
    let agent = e.agent(&node, "store");
    let pv = unique("pv-store");
    let image = e.image(&pv);
    e.volume(&pv, "data").await;
    let uid = e.pod("app", &node, "data").await;
    let va = e.attach(&pv, &node).await;

    let note = e.wait_event("default", &node, "ImageStoreNotReady").await;
    assert!(
        note.contains(MARKER) && note.contains("init-image-store"),
        "{note}"
    );
    let vas: Api<VolumeAttachment> = Api::all(e.client.clone());
    eventually(LIMIT, || async {
        let st = vas.get(&va).await.map_err(|e| e.to_string())?.status;
        let msg = st
            .as_ref()
            .and_then(|s| s.attach_error.as_ref())
            .and_then(|e| e.message.clone())
            .unwrap_or_default();
        match st.is_some_and(|s| s.attached) {
            true => Err("attached on an unmarked store".to_string()),
            false if msg.contains("image store not ready") => Ok(()),
            false => Err(format!("attach error {msg:?}")),
        }
    })
    .await;
    assert_eq!(gauge(&agent, "stowage_agent_image_store_ready", &[]), 0.0);
    assert_eq!(loops_of(&image), "", "no loop device over the image");

    std::fs::write(&marker, saved).unwrap();
    e.wait_attached(&va).await;
    let layout = e.layout(&node);
    let (target, global) = (layout.pod_mount(&uid, &pv), layout.global_mount(&pv));
    wait_mounted(&target).await;
    e.wait_event("default", &node, "ImageStoreReady").await;
    assert_eq!(gauge(&agent, "stowage_agent_image_store_ready", &[]), 1.0);
    e.release(&["app"], &[&target, &global], &va, &node, &pv).await;
}

//! Detaching: when a detach waits for unmount, when it is forced, and dead nodes.

use crate::world::*;

#[tokio::test]
async fn deleted_pod_loses_its_attachment() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.wait_node_attached(
        "node-a",
        vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop1".into())],
    )
    .await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_node_attached("node-a", vec![]).await;
    assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
}

#[tokio::test]
async fn volume_in_use_on_a_ready_node_waits_for_unmount() {
    let w = World::with_one_volume().await;
    // Even a short max wait never forces a detach from a Ready node.
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;

    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let waiting = c.metric("stowage_attachdetach_detaches_waiting_for_unmount", None);
        let longest = c.metric("stowage_attachdetach_longest_unmount_wait_seconds", None);
        // Well past the max wait: the detach is still held back.
        if waiting == 1.0 && longest > 4.0 {
            Ok(())
        } else {
            Err(format!("waiting {waiting}, longest wait {longest}s"))
        }
    })
    .await;
    assert!(
        w.vas()
            .get_opt(&attachment_name("vol-1", DRIVER, "node-a"))
            .await
            .unwrap()
            .is_some()
    );

    // The kubelet unmounts: now it goes.
    w.in_use("node-a", &[]).await;
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
}

#[tokio::test]
async fn volume_in_use_on_a_not_ready_node_is_detached_after_the_max_wait() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.node_status("node-a", json!({ "conditions": [ready_condition(false)], "volumesInUse": [unique_volume_name(DRIVER, "vol-1")] }))
        .await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_forced_detaches_total",
            Some(("reason", "timeout"))
        ),
        1.0
    );
    assert!(c.metric("stowage_attachdetach_unmount_wait_seconds_sum", None) >= 2.0);
}

#[tokio::test]
async fn out_of_service_taint_detaches_at_once() {
    let w = World::with_one_volume().await;
    // The max wait is the default (6 min): only the taint can make this detach happen.
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.node_status("node-a", json!({ "conditions": [ready_condition(false)], "volumesInUse": [unique_volume_name(DRIVER, "vol-1")] }))
        .await;
    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let waiting = c.metric("stowage_attachdetach_detaches_waiting_for_unmount", None);
        if waiting == 1.0 {
            Ok(())
        } else {
            Err(format!("{waiting} detaches waiting"))
        }
    })
    .await;

    let taint = json!({ "spec": { "taints": [{ "key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute" }] } });
    w.nodes()
        .patch("node-a", &PatchParams::default(), &Patch::Merge(taint))
        .await
        .unwrap();
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_forced_detaches_total",
            Some(("reason", "out-of-service"))
        ),
        1.0
    );
    assert_eq!(
        c.metric(
            "attach_detach_controller_attachdetach_controller_forced_detaches",
            Some(("reason", "out-of-service"))
        ),
        1.0
    );
}

/// A deleted Node is unhealthy, not proof of an unmount: its last volumesInUse holds the detach
/// back (upstream keeps the node and its volumesInUse), so nothing is detached at once.
#[tokio::test]
async fn deleted_node_keeps_attachments_it_last_reported_in_use() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;

    w.nodes()
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    w.delete_pod("app").await;
    eventually(LIMIT, || async {
        let waiting = c.metric("stowage_attachdetach_detaches_waiting_for_unmount", None);
        let longest = c.metric("stowage_attachdetach_longest_unmount_wait_seconds", None);
        if waiting == 1.0 && longest >= 2.0 {
            Ok(())
        } else {
            Err(format!("waiting {waiting}, longest wait {longest}s"))
        }
    })
    .await;
    let va = w
        .vas()
        .get_opt(&attachment_name("vol-1", DRIVER, "node-a"))
        .await
        .unwrap()
        .expect("the attachment of a gone node's mounted volume stays");
    assert!(va.metadata.deletion_timestamp.is_none());
    assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
}

/// ...and after --max-wait-for-unmount the gone node's volume is force-detached.
#[tokio::test]
async fn deleted_node_is_force_detached_after_the_max_wait() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;

    w.nodes()
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_forced_detaches_total",
            Some(("reason", "node-deleted"))
        ),
        1.0
    );
    // kube-controller-manager's counter knows no such reason: its own timeout forces it there.
    assert_eq!(
        c.metric(
            "attach_detach_controller_attachdetach_controller_forced_detaches",
            Some(("reason", "timeout"))
        ),
        1.0
    );
    assert!(c.metric("stowage_attachdetach_unmount_wait_seconds_sum", None) >= 2.0);
}

/// A forced detach of a node that is gone must finish although no agent is left there to drop
/// the attacher's finalizer: the controller releases it, says so, and the volume can move.
#[tokio::test]
async fn a_gone_nodes_attachment_is_released_after_the_forced_detach() {
    let w = World::start().await;
    w.node("node-a", true).await;
    w.node("node-b", true).await;
    w.bound_volume("vol-1", &["ReadWriteOnce"]).await;
    let c = Controller::start(&w.client, short_wait());
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.in_use("node-a", &["vol-1"]).await;
    // What node-a's agent did when it attached: its finalizer holds the VolumeAttachment.
    let name = attachment_name("vol-1", DRIVER, "node-a");
    w.vas()
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "metadata": { "finalizers": [stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER] } }),
            ),
        )
        .await
        .unwrap();

    // node-a dies with the agent; its pod is replaced on node-b.
    w.nodes()
        .delete("node-a", &DeleteParams::default())
        .await
        .unwrap();
    w.delete_pod("app").await;
    w.pod("app-2", "vol-1", "node-b").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_va("vol-1", "node-b").await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_operations_total",
            Some(("operation", "release"))
        ),
        1.0
    );
}

/// A running pod's volume stays desired when its claim stops resolving (the claim is no longer
/// Bound; the volume's claimRef names another UID): upstream only adds volumes while a pod lives
/// and drops them when it terminates or is deleted. Before, the volume left the desired state and
/// was detached — forced here after the short max wait, the node being NotReady with the volume
/// in use. The pod gets a Warning saying what is kept and why its claim does not resolve.
#[tokio::test]
async fn a_running_pods_volume_stays_attached_when_its_claim_stops_resolving() {
    let w = World::with_one_volume().await;
    // A resync every second rebuilds the desired state from the stores: that must keep it too.
    let c = Controller::start(
        &w.client,
        Config {
            resync: Duration::from_secs(1),
            ..short_wait()
        },
    );
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    w.node_status(
        "node-a",
        json!({ "conditions": [ready_condition(false)], "volumesInUse": [unique_volume_name(DRIVER, "vol-1")] }),
    )
    .await;
    w.wait_node_attached(
        "node-a",
        vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop1".into())],
    )
    .await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(w.client.clone(), NS);
    let pvs: Api<PersistentVolume> = Api::all(w.client.clone());
    let va = attachment_name("vol-1", DRIVER, "node-a");
    // Past the max wait (2 s) and several passes, the attachment is still there.
    let still_attached = || async {
        let before = c.metric("stowage_attachdetach_reconcile_total", None);
        tokio::time::sleep(Duration::from_secs(4)).await;
        passes(&c, before, 2.0).await;
        assert!(
            w.vas().get_opt(&va).await.unwrap().is_some(),
            "the running pod's volume was detached"
        );
        assert_eq!(c.metric("stowage_attachdetach_forced_detaches_total", None), 0.0);
    };

    // The claim is no longer Bound.
    claims
        .patch_status(
            "vol-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Pending" } })),
        )
        .await
        .unwrap();
    still_attached().await;
    let note = w.warning_note("app", "VolumeKeptAttached").await;
    assert!(
        note.contains("vol-1") && note.contains("not Bound") && note.contains("node-a"),
        "{note}"
    );

    // Bound again, but the volume's claimRef now names another UID.
    claims
        .patch_status(
            "vol-1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "phase": "Bound" } })),
        )
        .await
        .unwrap();
    pvs.patch(
        "vol-1",
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": { "claimRef": { "uid": "someone-else" } } })),
    )
    .await
    .unwrap();
    eventually(LIMIT, || async {
        let events: Api<Event> = Api::namespaced(w.client.clone(), NS);
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("VolumeKeptAttached"))
            .filter_map(|e| e.note.as_deref())
            .find(|n| n.contains("bound to another claim"))
            .map(|_| ())
            .ok_or_else(|| "no event about the claimRef yet".to_string())
    })
    .await;
    still_attached().await;

    // The pod goes: now the volume leaves the desired state and is detached.
    w.in_use("node-a", &[]).await;
    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
}

//! Attaching: pods get their attachments, node status reports them, single-node rules hold.

use crate::world::*;

#[tokio::test]
async fn scheduled_pod_gets_an_attachment_and_the_node_reports_it() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    w.pod("app", "vol-1", "node-a").await;

    let va = w.wait_va("vol-1", "node-a").await;
    assert_eq!(va.spec.attacher, DRIVER);
    assert_eq!(va.spec.node_name, "node-a");
    assert_eq!(va.spec.source.persistent_volume_name.as_deref(), Some("vol-1"));

    // Nothing is reported attached before the attacher says so; then with its device path.
    w.mark_attached("vol-1", "node-a", "/dev/loop7").await;
    w.wait_node_attached(
        "node-a",
        vec![(unique_volume_name(DRIVER, "vol-1"), "/dev/loop7".into())],
    )
    .await;
    eventually(LIMIT, || async {
        let v = c.metric(
            "stowage_attachdetach_volumes",
            Some(("state", "actual_state_of_world")),
        );
        if v == 1.0 {
            Ok(())
        } else {
            Err(format!("actual volumes gauge {v}"))
        }
    })
    .await;
    assert_eq!(
        c.metric(
            "stowage_attachdetach_volumes",
            Some(("state", "desired_state_of_world"))
        ),
        1.0
    );
}

#[tokio::test]
async fn single_node_volume_moves_only_after_the_first_pod_is_gone() {
    let w = World::start().await;
    w.node("node-a", true).await;
    w.node("node-b", true).await;
    w.bound_volume("vol-1", &["ReadWriteOnce"]).await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("first", "vol-1", "node-a", "/dev/loop1").await;

    w.pod("second", "vol-1", "node-b").await;
    let note = w.warning_note("second", "FailedAttachVolume").await;
    assert!(
        note.starts_with("Multi-Attach error for volume \"vol-1\" Volume is already used by pod(s) first"),
        "{note}"
    );
    assert!(
        note.contains("first"),
        "the holding pod is named in its own namespace: {note}"
    );
    assert_eq!(
        c.metric("stowage_attachdetach_multi_attach_errors_total", None),
        1.0
    );
    // Whatever else happened meanwhile, node-b got nothing.
    assert!(
        w.vas()
            .get_opt(&attachment_name("vol-1", DRIVER, "node-b"))
            .await
            .unwrap()
            .is_none()
    );

    w.delete_pod("first").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_va("vol-1", "node-b").await;
}

#[tokio::test]
async fn restart_keeps_what_should_stay_attached() {
    let w = World::with_one_volume().await;
    w.bound_volume("vol-2", &["ReadWriteOnce"]).await;
    let first = Controller::start(&w.client, Config::default());
    w.pod("app-1", "vol-1", "node-a").await;
    w.pod("app-2", "vol-2", "node-a").await;
    w.wait_va("vol-1", "node-a").await;
    w.wait_va("vol-2", "node-a").await;
    w.mark_attached("vol-1", "node-a", "/dev/loop1").await;
    w.mark_attached("vol-2", "node-a", "/dev/loop2").await;
    let both = vec![
        (unique_volume_name(DRIVER, "vol-1"), "/dev/loop1".to_string()),
        (unique_volume_name(DRIVER, "vol-2"), "/dev/loop2".to_string()),
    ];
    w.wait_node_attached("node-a", both.clone()).await;
    drop(first);

    let before: Vec<String> = w
        .vas()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|v| v.uid().unwrap())
        .collect();
    let second = Controller::start(&w.client, Config::default());
    // The first pass is where a wrong view of the world at start would act.
    passes(&second, 0.0, 1.0).await;
    // Pods come and go while it runs; the rest stays put.
    w.delete_pod("app-2").await;
    w.wait_no_va("vol-2", "node-a").await;
    let after = w
        .vas()
        .get(&attachment_name("vol-1", DRIVER, "node-a"))
        .await
        .unwrap();
    assert!(
        before.contains(&after.uid().unwrap()),
        "vol-1's attachment was re-created"
    );
    assert!(after.metadata.deletion_timestamp.is_none());
    w.wait_node_attached("node-a", vec![both[0].clone()]).await;
    assert_eq!(
        second.metric(
            "stowage_attachdetach_operations_total",
            Some(("operation", "attach"))
        ),
        0.0
    );
}

/// A generic ephemeral volume is the claim `<pod>-<volume>` that the pod controls; its volume is
/// attached like any other (upstream's populator resolves it the same way).
#[tokio::test]
async fn generic_ephemeral_volume_gets_an_attachment() {
    let w = World::start().await;
    w.node("node-a", true).await;
    let c = Controller::start(&w.client, Config::default());
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": "app", "namespace": NS },
        "spec": {
            "nodeName": "node-a",
            "containers": [{ "name": "c", "image": "busybox",
                "volumeMounts": [{ "name": "scratch", "mountPath": "/scratch" }] }],
            "volumes": [{ "name": "scratch", "ephemeral": { "volumeClaimTemplate": { "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": { "requests": { "storage": "1Gi" } }
            } } } }]
        }
    }))
    .unwrap();
    let pod = w.pods().create(&PostParams::default(), &pod).await.unwrap();
    // What the ephemeral-volume controller makes: the claim, controlled by the pod.
    let claims = Api::<PersistentVolumeClaim>::namespaced(w.client.clone(), NS);
    let mut claim = builders::pvc(NS, "app-scratch")
        .access_modes(&["ReadWriteOnce"])
        .volume_name("eph-1")
        .build();
    claim.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "app".into(),
            uid: pod.uid().unwrap(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        },
    ]);
    let claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let pvs: Api<PersistentVolume> = Api::all(w.client.clone());
    pvs.create(
        &PostParams::default(),
        &builders::pv("eph-1")
            .access_modes(&["ReadWriteOnce"])
            .claim_ref(NS, "app-scratch", &claim.uid().unwrap())
            .build(),
    )
    .await
    .unwrap();
    let bound = Patch::Merge(json!({ "status": { "phase": "Bound" } }));
    pvs.patch_status("eph-1", &PatchParams::default(), &bound)
        .await
        .unwrap();
    claims
        .patch_status("app-scratch", &PatchParams::default(), &bound)
        .await
        .unwrap();

    let va = w.wait_va("eph-1", "node-a").await;
    assert_eq!(va.spec.source.persistent_volume_name.as_deref(), Some("eph-1"));
    drop(c);
}

/// A ReadWriteMany loop volume still goes to one node at a time: ext4 on a loop image must not be
/// mounted read-write by two kernels. The waiting pod is told the rule.
#[tokio::test]
async fn read_write_many_loop_volume_is_attached_to_one_node_only() {
    let w = World::start().await;
    w.node("node-a", true).await;
    w.node("node-b", true).await;
    w.bound_volume("vol-1", &["ReadWriteMany"]).await;
    let c = Controller::start(&w.client, Config::default());
    w.attached_pod("first", "vol-1", "node-a", "/dev/loop1").await;

    w.pod("second", "vol-1", "node-b").await;
    let note = w.warning_note("second", "FailedAttachVolume").await;
    assert!(note.contains("one node at a time"), "{note}");
    assert!(
        w.vas()
            .get_opt(&attachment_name("vol-1", DRIVER, "node-b"))
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        c.metric("stowage_attachdetach_multi_attach_errors_total", None),
        1.0
    );
    // Once the first node lets go, the second gets it.
    w.delete_pod("first").await;
    w.wait_no_va("vol-1", "node-a").await;
    w.wait_va("vol-1", "node-b").await;
}

/// A loop PV carries the attacher's finalizer while a VolumeAttachment names it (as
/// external-attacher keeps it), so it cannot vanish under an attachment; it goes with the last one.
#[tokio::test]
async fn an_attached_loop_volume_is_protected_by_the_attacher_finalizer() {
    let w = World::with_one_volume().await;
    let _c = Controller::start(&w.client, Config::default());
    let pvs: Api<PersistentVolume> = Api::all(w.client.clone());
    let has_finalizer = |want: bool| {
        let pvs = pvs.clone();
        async move {
            eventually(LIMIT, || {
                let pvs = pvs.clone();
                async move {
                    let pv = pvs.get("vol-1").await.map_err(|e| e.to_string())?;
                    let has = pv
                        .finalizers()
                        .iter()
                        .any(|f| f == stowage_common::vocab::annotations::LOOP_ATTACHER_FINALIZER);
                    if has == want {
                        Ok(())
                    } else {
                        Err(format!("finalizers of vol-1: {:?}", pv.finalizers()))
                    }
                }
            })
            .await
        }
    };
    w.attached_pod("app", "vol-1", "node-a", "/dev/loop1").await;
    has_finalizer(true).await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    has_finalizer(false).await;
}

/// What a kube-controller-manager dashboard reads: `storage_operation_duration_seconds` for an
/// attach whose attacher fails once (`fail-unknown`) and then succeeds, and for the detach, under
/// KCM's plugin name for a CSI volume.
#[tokio::test]
async fn attach_and_detach_show_in_kube_controller_managers_operation_metric() {
    let w = World::with_one_volume().await;
    let c = Controller::start(&w.client, Config::default());
    stowage_common::observe::storageops::register_metrics(&c.registry);
    let plugin = "kubernetes.io/csi:loop.stowage.dev";
    let until = |op: &'static str, status: &'static str| {
        let c = &c;
        async move {
            eventually(LIMIT, || async move {
                let labels = [
                    ("volume_plugin", plugin),
                    ("operation_name", op),
                    ("status", status),
                    ("migrated", "false"),
                ];
                let n = c.metric_with("storage_operation_duration_seconds_count", &labels);
                if n >= 1.0 {
                    Ok(())
                } else {
                    Err(format!("no {op} {status} observed"))
                }
            })
            .await
        }
    };
    w.pod("app", "vol-1", "node-a").await;
    w.wait_va("vol-1", "node-a").await;
    let name = attachment_name("vol-1", DRIVER, "node-a");
    let failed = json!({ "status": { "attached": false, "attachError": { "message": "test: not yet" } } });
    w.vas()
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(failed))
        .await
        .unwrap();
    until("volume_attach", "fail-unknown").await;
    let ok = json!({ "status": { "attached": true, "attachError": null, "attachmentMetadata": { "devicePath": "/dev/loop3" } } });
    w.vas()
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(ok))
        .await
        .unwrap();
    until("volume_attach", "success").await;

    w.delete_pod("app").await;
    w.wait_no_va("vol-1", "node-a").await;
    until("volume_detach", "success").await;
}

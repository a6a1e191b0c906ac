//! The expand controller against the real apiserver.

mod common;

use common::*;
use kube::api::{Patch, PatchParams, PostParams};
use stowage_testkit::builders::storage_class;
use stowage_testkit::{eventually, unique};

const LOOP: &str = "loop.stowage.dev";
const MI: u64 = 1 << 20;

async fn class(h: &Harness, provisioner: &str, allow: bool) -> String {
    let name = unique("sc");
    h.classes()
        .create(
            &PostParams::default(),
            &storage_class(&name, provisioner).allow_expansion(allow).build(),
        )
        .await
        .unwrap();
    name
}

async fn set_allow(h: &Harness, class: &str, allow: bool) {
    let patch = serde_json::json!({"allowVolumeExpansion": allow});
    h.classes()
        .patch(class, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

fn node_pending(c: &k8s_openapi::api::core::v1::PersistentVolumeClaim) -> bool {
    status_entry(c).as_deref() == Some("NodeResizePending")
}

#[tokio::test]
async fn a_bound_loop_volume_grows_and_is_then_left_alone() {
    let h = Harness::start().await;
    stowage_common::observe::storageops::register_metrics(&h.registry);
    stowage_common::runtime::queue::register_metrics(&h.registry);
    h.namespace("app").await;
    let sc = class(&h, LOOP, true).await;
    let pv = h.bound("app", "data", &sc, "64Mi", LOOP, false).await;
    h.request("app", "data", "128Mi").await;

    let c = h
        .claim_until("app", "data", "NodeResizePending", node_pending)
        .await;
    assert_eq!(allocated(&c).as_deref(), Some("128Mi"));
    assert_eq!(
        capacity(&c).as_deref(),
        Some("64Mi"),
        "the file system has not grown yet"
    );
    let conds = conditions(&c);
    assert!(
        conds.contains(&"FileSystemResizePending".to_string()),
        "{conds:?}"
    );
    assert!(
        !conds.contains(&"Resizing".to_string()),
        "the controller's work is done: {conds:?}"
    );
    assert_eq!(h.image_size(&pv), 128 * MI);
    let v = h.pvs().get(&pv).await.unwrap();
    assert_eq!(pv_capacity(&v), "128Mi");
    assert_eq!(
        anns(&v)
            .get("volume.alpha.kubernetes.io/pre-resize-capacity")
            .map(String::as_str),
        Some("64Mi")
    );
    h.event("app", "data", "Resizing").await;
    h.event("app", "data", "FileSystemResizeRequired").await;

    // The node's half, as the kubelet (or stowage-agent) does it.
    h.node_finishes("app", "data").await;
    h.claim_until("app", "data", "capacity 128Mi, no resize state", |c| {
        capacity(c).as_deref() == Some("128Mi") && status_entry(c).is_none() && conditions(c).is_empty()
    })
    .await;
    let v = eventually(WAIT, || async {
        let v = h.pvs().get(&pv).await.map_err(|e| e.to_string())?;
        if anns(&v).contains_key("volume.alpha.kubernetes.io/pre-resize-capacity") {
            Err("pre-resize-capacity still on the PV".to_string())
        } else {
            Ok(v)
        }
    })
    .await;
    // Converged: once a sync has run after the last change, the claim read then is not written
    // again by the next one (the resync), and the PV neither.
    h.until_counter_grows("stowage_expand_reconcile_total").await;
    let c = h.pvcs("app").get("data").await.unwrap();
    h.until_counter_grows("stowage_expand_reconcile_total").await;
    let c2 = h.pvcs("app").get("data").await.unwrap();
    let v2 = h.pvs().get(&pv).await.unwrap();
    assert_eq!(
        c2.metadata.resource_version, c.metadata.resource_version,
        "claim rewritten after convergence"
    );
    assert_eq!(
        v2.metadata.resource_version, v.metadata.resource_version,
        "PV rewritten after convergence"
    );
    assert!(h.events("app", "data", "VolumeResizeFailed").await.is_empty());
    let m = h.metrics_text();
    assert!(
        m.contains("stowage_expand_expansions_total{state=\"node_pending\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("stowage_expand_expansion_duration_seconds_count{stage=\"total\"} 1"),
        "{m}"
    );
    // kube-controller-manager's names: the expansion and the queue.
    let m = stowage_testkit::scrape::parse(&m).unwrap();
    let labels = [
        ("volume_plugin", "kubernetes.io/csi:loop.stowage.dev"),
        ("operation_name", "expand_volume"),
        ("status", "success"),
        ("migrated", "false"),
    ];
    assert!(m.sum_where("storage_operation_duration_seconds_count", &labels) >= 1.0);
    assert!(m.sum_where("workqueue_adds_total", &[("name", "volume_expand")]) >= 1.0);
}

#[tokio::test]
async fn a_class_without_allow_volume_expansion_gets_a_warning_and_nothing_changes() {
    let mut h = Harness::new().await;
    h.namespace("app").await;
    let sc = class(&h, LOOP, false).await;
    let pv = h.bound("app", "data", &sc, "64Mi", LOOP, false).await;
    // What a user hits first: the apiserver's admission refuses the larger request.
    let refused = h.try_request("app", "data", "128Mi").await.unwrap_err();
    assert!(
        matches!(&refused, kube::Error::Api(s) if s.code == 403),
        "{refused:?}"
    );
    // What reaches the controller: the class allowed it when the user asked, and an admin
    // turned expansion off before the controller acted (here: before it runs).
    set_allow(&h, &sc, true).await;
    h.request("app", "data", "128Mi").await;
    set_allow(&h, &sc, false).await;
    h.run_controller().await;
    let note = h.event("app", "data", "VolumeExpansionNotAllowed").await;
    assert!(note.contains("allowVolumeExpansion"), "{note}");
    let c = h.pvcs("app").get("data").await.unwrap();
    assert_eq!(allocated(&c), None);
    assert_eq!(status_entry(&c), None);
    assert_eq!(capacity(&c).as_deref(), Some("64Mi"));
    assert_eq!(pv_capacity(&h.pvs().get(&pv).await.unwrap()), "64Mi");
    assert_eq!(h.image_size(&pv), 64 * MI);
    let warnings = h.events("app", "data", "VolumeExpansionNotAllowed").await;
    assert_eq!(warnings.len(), 1, "reported once, not every sync");

    // Allowing it again lets the expansion go ahead.
    set_allow(&h, &sc, true).await;
    h.claim_until("app", "data", "NodeResizePending", node_pending)
        .await;
    assert_eq!(h.image_size(&pv), 128 * MI);
}

#[tokio::test]
async fn a_failure_mid_way_is_reported_and_the_retry_completes_after_the_fix() {
    let h = Harness::start().await;
    stowage_common::observe::storageops::register_metrics(&h.registry);
    h.namespace("app").await;
    let sc = class(&h, LOOP, true).await;
    let pv = h.bound("app", "data", &sc, "64Mi", LOOP, false).await;
    let lock = Immutable::set(&h.image(&pv));
    h.request("app", "data", "128Mi").await;

    let note = h.event("app", "data", "VolumeResizeFailed").await;
    assert!(note.contains("128Mi"), "{note}");
    let c = h
        .claim_until("app", "data", "ControllerResizeError", |c| {
            conditions(c).contains(&"ControllerResizeError".to_string())
        })
        .await;
    assert_eq!(status_entry(&c).as_deref(), Some("ControllerResizeInProgress"));
    assert_eq!(allocated(&c).as_deref(), Some("128Mi"));
    assert_eq!(
        pv_capacity(&h.pvs().get(&pv).await.unwrap()),
        "64Mi",
        "nothing recorded that did not happen"
    );

    drop(lock); // the fix
    let c = h
        .claim_until("app", "data", "NodeResizePending", node_pending)
        .await;
    assert!(!conditions(&c).contains(&"ControllerResizeError".to_string()));
    assert_eq!(h.image_size(&pv), 128 * MI);
    h.node_finishes("app", "data").await;
    h.claim_until("app", "data", "capacity 128Mi", |c| {
        capacity(c).as_deref() == Some("128Mi") && conditions(c).is_empty()
    })
    .await;
    assert!(h.events("app", "data", "VolumeResizeSuccessful").await.is_empty());
    let m = h.metrics_text();
    assert!(
        m.contains("stowage_expand_failures_total{error=\"image\"}"),
        "{m}"
    );
    // kube-controller-manager's view: the failed attempt and the one that worked.
    let m = stowage_testkit::scrape::parse(&m).unwrap();
    for status in ["fail-unknown", "success"] {
        let labels = [
            ("volume_plugin", "kubernetes.io/csi:loop.stowage.dev"),
            ("operation_name", "expand_volume"),
            ("status", status),
            ("migrated", "false"),
        ];
        assert!(
            m.sum_where("storage_operation_duration_seconds_count", &labels) >= 1.0,
            "no expand_volume {status}"
        );
    }
}

#[tokio::test]
async fn two_expansions_in_quick_succession_end_at_the_larger_size() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let sc = class(&h, LOOP, true).await;
    let pv = h.bound("app", "data", &sc, "64Mi", LOOP, false).await;
    h.request("app", "data", "128Mi").await;
    h.request("app", "data", "192Mi").await;
    // Play the node whenever it is its turn, until the claim has the larger size.
    eventually(WAIT, || async {
        let c = h.pvcs("app").get("data").await.map_err(|e| e.to_string())?;
        if node_pending(&c) {
            h.node_finishes("app", "data").await;
        }
        if capacity(&c).as_deref() == Some("192Mi") && status_entry(&c).is_none() {
            Ok(())
        } else {
            Err(format!("claim at {:?}, {:?}", capacity(&c), status_entry(&c)))
        }
    })
    .await;
    assert_eq!(h.image_size(&pv), 192 * MI);
    assert_eq!(pv_capacity(&h.pvs().get(&pv).await.unwrap()), "192Mi");
}

#[tokio::test]
async fn lowering_the_request_after_an_infeasible_expansion_recovers() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let sc = class(&h, LOOP, true).await;
    let pv = h.bound("app", "data", &sc, "64Mi", LOOP, false).await;
    // A typo no file system can hold (ext4 files end at 16Ti): EFBIG, infeasible.
    h.request("app", "data", "20Ti").await;
    let note = h.event("app", "data", "VolumeResizeFailed").await;
    assert!(note.contains("20Ti"), "{note}");
    let c = h
        .claim_until("app", "data", "ControllerResizeInfeasible", |c| {
            status_entry(c).as_deref() == Some("ControllerResizeInfeasible")
        })
        .await;
    assert_eq!(allocated(&c).as_deref(), Some("20Ti"));
    assert!(conditions(&c).contains(&"ControllerResizeError".to_string()));
    assert_eq!(pv_capacity(&h.pvs().get(&pv).await.unwrap()), "64Mi");
    assert_eq!(h.image_size(&pv), 64 * MI);

    // RecoverVolumeExpansionFailure: the apiserver lets the user lower the request, though
    // only to a size above status.capacity; back to 64Mi itself is refused.
    assert!(h.try_request("app", "data", "64Mi").await.is_err());
    h.request("app", "data", "128Mi").await;
    let c = h
        .claim_until("app", "data", "NodeResizePending", node_pending)
        .await;
    assert_eq!(
        allocated(&c).as_deref(),
        Some("128Mi"),
        "the allocation follows the lowered request"
    );
    assert!(!conditions(&c).contains(&"ControllerResizeError".to_string()));
    h.node_finishes("app", "data").await;
    h.claim_until("app", "data", "capacity 128Mi, no resize state", |c| {
        capacity(c).as_deref() == Some("128Mi") && status_entry(c).is_none() && conditions(c).is_empty()
    })
    .await;
    assert_eq!(h.image_size(&pv), 128 * MI);
    assert!(h.events("app", "data", "VolumeResizeSuccessful").await.is_empty());
    let m = h.metrics_text();
    assert!(
        m.contains("stowage_expand_failures_total{error=\"infeasible\"} 1"),
        "{m}"
    );
}

#[tokio::test]
async fn other_drivers_are_handed_to_their_external_resizer() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let driver = "disk.vendor.example.com";
    let sc = class(&h, driver, true).await;
    let pv = h.bound("app", "data", &sc, "1Gi", driver, false).await;
    h.request("app", "data", "2Gi").await;
    let note = h.event("app", "data", "ExternalExpanding").await;
    assert!(note.contains(driver) && note.contains("2Gi"), "{note}");
    // As upstream: nothing on the claim changes (external-resizer finds it by the PV's driver),
    // and the event is not repeated by the next resyncs (10 s here). Two syncs after the one
    // that reported: an event the first of them queued (events are posted apart from the sync)
    // has landed by the time the second runs.
    h.until_counter_grows_by("stowage_expand_reconcile_total", 2.0)
        .await;
    // A repeat would not be a second object: the recorder folds it into the first one's series.
    let events = h.events("app", "data", "ExternalExpanding").await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].series, None, "the event was repeated");
    let c = h.pvcs("app").get("data").await.unwrap();
    assert!(!anns(&c).contains_key("volume.kubernetes.io/storage-resizer"));
    assert_eq!(status_entry(&c), None);
    assert_eq!(allocated(&c), None);
    assert_eq!(pv_capacity(&h.pvs().get(&pv).await.unwrap()), "1Gi");
}

#[tokio::test]
async fn an_unattached_block_volume_finishes_without_a_node_step() {
    let h = Harness::start().await;
    h.namespace("app").await;
    let sc = class(&h, LOOP, true).await;
    let pv = h.bound("app", "raw", &sc, "64Mi", LOOP, true).await;
    h.request("app", "raw", "128Mi").await;
    let c = h
        .claim_until("app", "raw", "capacity 128Mi", |c| {
            capacity(c).as_deref() == Some("128Mi")
        })
        .await;
    assert_eq!(status_entry(&c), None);
    assert!(conditions(&c).is_empty());
    assert_eq!(h.image_size(&pv), 128 * MI);
    h.event("app", "raw", "VolumeResizeSuccessful").await;
}

/// A migrated in-tree volume (its PV still says `awsElasticBlockStore`) is handed to the CSI
/// driver that took the plugin over, as upstream does: the claim gets
/// `volume.kubernetes.io/storage-resizer: ebs.csi.aws.com`, which is what that driver's
/// external-resizer acts on. Before, only an event went out and the claim was never expanded.
#[tokio::test]
async fn a_migrated_in_tree_claim_names_its_csi_resizer() {
    use stowage_testkit::builders::pvc;
    let h = Harness::start().await;
    h.namespace("app").await;
    let sc = class(&h, "kubernetes.io/aws-ebs", true).await;
    let c = h
        .pvcs("app")
        .create(
            &PostParams::default(),
            &pvc("app", "legacy")
                .request("1Gi")
                .class(&sc)
                .volume_name("pv-legacy")
                .build(),
        )
        .await
        .unwrap();
    let pv: k8s_openapi::api::core::v1::PersistentVolume = serde_json::from_value(serde_json::json!({
        "metadata": { "name": "pv-legacy" },
        "spec": {
            "capacity": { "storage": "1Gi" }, "accessModes": ["ReadWriteOnce"],
            "storageClassName": sc, "persistentVolumeReclaimPolicy": "Retain",
            "awsElasticBlockStore": { "volumeID": "aws://us-east-1a/vol-0abc" },
            "claimRef": { "namespace": "app", "name": "legacy", "uid": c.metadata.uid }
        }
    }))
    .unwrap();
    let mut pv = h.pvs().create(&PostParams::default(), &pv).await.unwrap();
    pv.status.get_or_insert_with(Default::default).phase = Some("Bound".into());
    h.pvs()
        .replace_status("pv-legacy", &PostParams::default(), &pv)
        .await
        .unwrap();
    let mut c = c;
    let st = c.status.get_or_insert_with(Default::default);
    st.phase = Some("Bound".into());
    st.capacity = Some(
        [(
            "storage".to_string(),
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("1Gi".into()),
        )]
        .into(),
    );
    h.pvcs("app")
        .replace_status("legacy", &PostParams::default(), &c)
        .await
        .unwrap();
    h.request("app", "legacy", "2Gi").await;
    let c = eventually(std::time::Duration::from_secs(60), || async {
        let c = h.pvcs("app").get("legacy").await.map_err(|e| e.to_string())?;
        match anns(&c).get("volume.kubernetes.io/storage-resizer") {
            Some(_) => Ok(c),
            None => Err("no resizer annotation yet".to_string()),
        }
    })
    .await;
    assert_eq!(
        anns(&c)["volume.kubernetes.io/storage-resizer"],
        "ebs.csi.aws.com"
    );
    let note = h.event("app", "legacy", "ExternalExpanding").await;
    assert_eq!(
        note,
        "CSI migration enabled for kubernetes.io/aws-ebs; waiting for external resizer to expand the pvc"
    );
    // The resize itself is the external-resizer's: nothing else on the claim or volume changed.
    assert_eq!(status_entry(&c), None);
    assert_eq!(pv_capacity(&h.pvs().get("pv-legacy").await.unwrap()), "1Gi");
}

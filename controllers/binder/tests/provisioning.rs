//! The binder against the real apiserver: provisioning (built-in and handed off), storage
//! classes (missing, default, no-provisioner, WaitForFirstConsumer) and CSI migration.

mod common;

use std::collections::BTreeMap;

use common::{Harness, WAIT};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use stowage_testkit::builders::{pv, pvc, storage_class};
use stowage_testkit::eventually;

fn anns(o: &impl ResourceExt) -> BTreeMap<String, String> {
    o.annotations().clone()
}

#[tokio::test]
async fn built_in_provisioning_creates_image_and_prebound_volume() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(
        storage_class("loop", "loop.stowage.dev")
            .parameter("fsType", "ext4")
            .build(),
    )
    .await;
    let c = h
        .create_pvc(pvc("app", "dyn").request("64Mi").class("loop").build())
        .await;
    let bound = h.claim_phase("app", "dyn", "Bound").await;
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    assert_eq!(
        bound.spec.as_ref().unwrap().volume_name.as_deref(),
        Some(name.as_str())
    );
    assert_eq!(
        anns(&bound)
            .get("volume.kubernetes.io/storage-provisioner")
            .map(String::as_str),
        Some("loop.stowage.dev")
    );
    assert_eq!(
        anns(&bound)
            .get("volume.beta.kubernetes.io/storage-provisioner")
            .map(String::as_str),
        Some("loop.stowage.dev")
    );
    let v = h.volume_phase(&name, "Bound").await;
    assert_eq!(
        anns(&v)
            .get("pv.kubernetes.io/provisioned-by")
            .map(String::as_str),
        Some("loop.stowage.dev")
    );
    assert!(!anns(&v).contains_key("loop.stowage.dev/image-pending"));
    assert!(v.finalizers().iter().any(|f| f == "loop.stowage.dev/deleter"));
    let spec = v.spec.unwrap();
    assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Delete"));
    assert_eq!(spec.csi.as_ref().unwrap().fs_type.as_deref(), Some("ext4"));
    let img = h.images.path().join(format!("{name}.img"));
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 64 << 20);
    h.event("dyn", "ProvisioningSucceeded").await;

    // Deleting the claim deletes the provisioned volume and its image.
    h.delete_claim("app", "dyn").await;
    eventually(WAIT, || async {
        if img.exists() {
            Err("image still there".to_string())
        } else {
            Ok(())
        }
    })
    .await;
}

#[tokio::test]
async fn other_provisioners_get_the_claim_handed_over() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("ext", "example.com/external").build())
        .await;
    h.create_pvc(pvc("app", "x").class("ext").build()).await;
    let note = h.event("x", "ExternalProvisioning").await;
    assert!(note.contains("example.com/external"), "{note}");
    // The event is queued apart from the annotation write: either may land first.
    let c = h
        .claim_until("app", "x", "the storage-provisioner annotation", |c| {
            anns(c)
                .get("volume.kubernetes.io/storage-provisioner")
                .is_some_and(|p| p == "example.com/external")
        })
        .await;
    assert_eq!(
        anns(&c)
            .get("volume.beta.kubernetes.io/storage-provisioner")
            .map(String::as_str),
        Some("example.com/external")
    );
    assert!(
        h.pvs().list(&Default::default()).await.unwrap().items.is_empty(),
        "nothing provisioned by us"
    );

    // The external provisioner's PV, pre-bound with the claim's UID, completes the bind.
    let mut ext = pv("ext-vol")
        .class("ext")
        .driver("external.example.com", "h1")
        .claim_ref("app", "x", &c.metadata.uid.clone().unwrap())
        .build();
    ext.metadata.annotations = Some(BTreeMap::from([(
        "pv.kubernetes.io/provisioned-by".into(),
        "example.com/external".into(),
    )]));
    h.create_pv(ext).await;
    h.claim_phase("app", "x", "Bound").await;
}

#[tokio::test]
async fn a_no_provisioner_class_waits_for_a_static_volume() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("local", "kubernetes.io/no-provisioner").build())
        .await;
    h.create_pv(pv("small").class("local").capacity("1Gi").build())
        .await;
    // The claim must meet the volume in the controller's cache, or the note names no candidate.
    h.volume_phase("small", "Available").await;
    h.create_pvc(pvc("app", "c").class("local").request("2Gi").build())
        .await;
    let note = h.event("c", "ProvisioningFailed").await;
    assert!(
        note.contains("no volume plugin matched name: kubernetes.io/no-provisioner"),
        "{note}"
    );
    assert!(
        note.contains("small: too small: 1Gi < 2Gi"),
        "names the nearest candidate and why: {note}"
    );
    let c = h.pvcs("app").get("c").await.unwrap();
    assert!(
        !c.annotations()
            .contains_key("volume.kubernetes.io/storage-provisioner")
    );
    // A volume that fits, created later, is picked up without waiting for a resync.
    h.create_pv(pv("big").class("local").capacity("2Gi").build())
        .await;
    let c = h.claim_phase("app", "c", "Bound").await;
    assert_eq!(c.spec.unwrap().volume_name.as_deref(), Some("big"));
}

#[tokio::test]
async fn a_missing_class_is_reported_and_the_claim_waits() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pvc(pvc("app", "m").class("nope").build()).await;
    let note = h.event("m", "ProvisioningFailed").await;
    assert!(note.contains("\"nope\" not found"), "{note}");
    // The event is queued apart from the status write: either may land first.
    h.claim_until("app", "m", "Pending with a ProvisioningFailed condition", |c| {
        let st = c.status.as_ref();
        st.and_then(|s| s.phase.as_deref()) == Some("Pending")
            && st.and_then(|s| s.conditions.as_ref()).is_some_and(|cs| {
                cs.iter().any(|c| {
                    c.type_ == "stowage.dev/Pending" && c.reason.as_deref() == Some("ProvisioningFailed")
                })
            })
    })
    .await;
    // Creating the class unblocks it without waiting for a resync.
    h.create::<StorageClass>(storage_class("nope", "loop.stowage.dev").build())
        .await;
    h.claim_phase("app", "m", "Bound").await;
}

/// Delayed binding as upstream's controller does it: no free volume is taken, before or after
/// the scheduler selects a node. A volume the scheduler chose (its claimRef written, as the
/// volume-binding plugin does) is bound; a selected node means the scheduler chose provisioning,
/// so the built-in provisioner makes a volume even though a free one would fit.
#[tokio::test]
async fn wait_for_first_consumer_leaves_free_volumes_to_the_scheduler() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(
        storage_class("late", "loop.stowage.dev")
            .wait_for_first_consumer()
            .build(),
    )
    .await;
    h.create_pv(pv("free").class("late").capacity("2Gi").build())
        .await;
    h.create::<k8s_openapi::api::core::v1::Node>(
        stowage_testkit::builders::node("node-a")
            .label("kubernetes.io/hostname", "node-a")
            .build(),
    )
    .await;
    h.volume_phase("free", "Available").await;

    // The scheduler picks the free volume for claim "s": it writes the volume's claimRef.
    let s = h.create_pvc(pvc("app", "s").class("late").build()).await;
    h.event("s", "WaitForFirstConsumer").await;
    let chosen = serde_json::json!({
        "metadata": {"annotations": {"pv.kubernetes.io/bound-by-controller": "yes"}},
        "spec": {"claimRef": {"kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": "app",
                              "name": "s", "uid": s.metadata.uid.clone().unwrap()}},
    });
    h.pvs()
        .patch(
            "free",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&chosen),
        )
        .await
        .unwrap();
    let bound = h.claim_phase("app", "s", "Bound").await;
    assert_eq!(bound.spec.unwrap().volume_name.as_deref(), Some("free"));

    // Another free volume that would fit stays free once a node is selected for claim "w":
    // the claim gets a volume of its own.
    h.create_pv(pv("spare").class("late").capacity("2Gi").build())
        .await;
    h.volume_phase("spare", "Available").await;
    let w = h
        .create_pvc(pvc("app", "w").class("late").request("16Mi").build())
        .await;
    h.event("w", "WaitForFirstConsumer").await;
    let patch =
        serde_json::json!({"metadata": {"annotations": {"volume.kubernetes.io/selected-node": "node-a"}}});
    h.pvcs("app")
        .patch(
            "w",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let c = h.claim_phase("app", "w", "Bound").await;
    let provisioned = format!("pvc-{}", w.metadata.uid.unwrap());
    assert_eq!(c.spec.unwrap().volume_name.as_deref(), Some(provisioned.as_str()));
    let spare = h.pvs().get("spare").await.unwrap();
    assert_eq!(
        spare.spec.unwrap().claim_ref,
        None,
        "the free volume was not taken"
    );
}

#[tokio::test]
async fn selectors_modes_and_attribute_classes_are_matched() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create_pv(pv("plain").build()).await;
    h.create_pv(pv("gold").label("tier", "gold").capacity("2Gi").build())
        .await;
    h.create_pv(pv("blk").block().capacity("3Gi").build()).await;
    h.create_pv(
        pv("rwx")
            .access_modes(&["ReadWriteMany", "ReadWriteOnce"])
            .capacity("4Gi")
            .build(),
    )
    .await;
    h.create_pv(pv("vac").attributes_class("fast").capacity("5Gi").build())
        .await;
    // Every candidate must be in the controller's cache before the claims, so the failure note
    // below is about the attributes class and not about an empty cache.
    for v in ["plain", "gold", "blk", "rwx", "vac"] {
        h.volume_phase(v, "Available").await;
    }
    h.create_pvc(pvc("app", "sel").class("").selector("tier", "gold").build())
        .await;
    h.create_pvc(pvc("app", "block").class("").block().build()).await;
    h.create_pvc(
        pvc("app", "many")
            .class("")
            .access_modes(&["ReadWriteMany"])
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "attrs").class("").attributes_class("fast").build())
        .await;
    h.create_pvc(
        pvc("app", "other-attrs")
            .class("")
            .attributes_class("slow")
            .build(),
    )
    .await;
    let vol = |c: k8s_openapi::api::core::v1::PersistentVolumeClaim| c.spec.unwrap().volume_name.unwrap();
    assert_eq!(vol(h.claim_phase("app", "sel", "Bound").await), "gold");
    assert_eq!(vol(h.claim_phase("app", "block", "Bound").await), "blk");
    assert_eq!(vol(h.claim_phase("app", "many", "Bound").await), "rwx");
    assert_eq!(vol(h.claim_phase("app", "attrs", "Bound").await), "vac");
    let note = h.event("other-attrs", "FailedBinding").await;
    assert!(
        note.contains("volume attributes class"),
        "the event says why: {note}"
    );
    h.volume_phase("plain", "Available").await;
}

#[tokio::test]
async fn a_class_less_claim_gets_the_default_class_retroactively() {
    let h = Harness::start().await;
    h.namespace("app").await;
    // Created before any default class exists, so admission leaves the class unset.
    h.create_pvc(pvc("app", "late").build()).await;
    h.claim_phase("app", "late", "Pending").await;
    h.create::<StorageClass>(storage_class("std", "loop.stowage.dev").default_class().build())
        .await;
    let c = h.claim_phase("app", "late", "Bound").await;
    assert_eq!(c.spec.unwrap().storage_class_name.as_deref(), Some("std"));
}

#[tokio::test]
async fn in_tree_classes_and_volumes_are_handed_to_their_csi_drivers() {
    let h = Harness::start().await;
    h.namespace("app").await;
    // A cluster whose default class is the in-tree gp2 (issue: every claim stayed Pending).
    h.create::<StorageClass>(storage_class("gp2", "kubernetes.io/aws-ebs").build())
        .await;
    h.create_pvc(pvc("app", "c").class("gp2").build()).await;
    let note = h.event("c", "ExternalProvisioning").await;
    assert!(note.contains("'ebs.csi.aws.com'"), "{note}");
    let c = h
        .claim_until(
            "app",
            "c",
            "the CSI driver's storage-provisioner annotations",
            |c| {
                let a = anns(c);
                a.get("volume.kubernetes.io/storage-provisioner")
                    .is_some_and(|p| p == "ebs.csi.aws.com")
                    && a.get("volume.beta.kubernetes.io/storage-provisioner")
                        .is_some_and(|p| p == "ebs.csi.aws.com")
            },
        )
        .await;
    assert!(h.events(Some("app"), "c", "ProvisioningFailed").await.is_empty());
    assert_eq!(c.status.unwrap().phase.as_deref(), Some("Pending"));

    // A volume the in-tree plugin made before, still carrying its in-tree deletion finalizer.
    let mut made = pv("pvc-old")
        .class("gp2")
        .reclaim("Delete")
        .driver("ebs.csi.aws.com", "vol-0abc")
        .build();
    made.metadata.annotations = Some(BTreeMap::from([(
        "pv.kubernetes.io/provisioned-by".into(),
        "kubernetes.io/aws-ebs".into(),
    )]));
    made.metadata.finalizers = Some(vec!["kubernetes.io/pv-controller".into()]);
    h.create_pv(made).await;
    stowage_testkit::eventually(WAIT, || async {
        let v = h.pvs().get("pvc-old").await.unwrap();
        let marked = anns(&v)
            .get("pv.kubernetes.io/migrated-to")
            .is_some_and(|d| d == "ebs.csi.aws.com");
        let guarded = v.finalizers().iter().any(|f| f == "kubernetes.io/pv-controller");
        if marked && !guarded {
            Ok(())
        } else {
            Err(format!("migrated-to {marked}, in-tree finalizer {guarded}"))
        }
    })
    .await;
    // Binding is unaffected: the claim still waiting in that class takes the volume.
    h.volume_phase("pvc-old", "Bound").await;
}

#[tokio::test]
async fn a_delayed_claim_says_which_pod_it_waits_for() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(
        storage_class("late", "example.com/external")
            .wait_for_first_consumer()
            .build(),
    )
    .await;
    h.create_pvc(pvc("app", "w").class("late").build()).await;
    h.event("w", "WaitForFirstConsumer").await;
    // A consumer appears, not yet scheduled: the claim names it.
    h.pods("app")
        .create(
            &Default::default(),
            &stowage_testkit::builders::pod("app", "web-0")
                .claim("data", "w")
                .build(),
        )
        .await
        .unwrap();
    let note = h.event("w", "WaitForPodScheduled").await;
    assert_eq!(note, "waiting for pod web-0 to be scheduled");
}

/// What `blkid -p` finds on an image: its TYPE, or `None` when blank.
fn fs_on(image: &std::path::Path) -> Option<String> {
    let out = std::process::Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(image)
        .output()
        .expect("blkid");
    match out.status.code() {
        Some(2) => None,
        Some(0) => Some(String::from_utf8_lossy(&out.stdout).trim().to_string()),
        other => panic!(
            "blkid {image:?}: {other:?} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// A claim whose only access mode is ReadOnlyMany (volume mode Filesystem) gets its ext4 made
/// by the provisioner: every node stages it read-only and never formats a device it cannot
/// write, so an image left blank could never be mounted (pods waited forever). The node stages
/// it read-only, for real. Block, and claims with a writer mode, stay blank as before (a
/// writer's first stage formats them).
#[tokio::test]
async fn a_read_only_many_filesystem_claim_gets_its_file_system_at_creation() {
    let h = Harness::start().await;
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let mut images = BTreeMap::new();
    for (name, modes, block) in [
        ("rox", &["ReadOnlyMany"][..], false),
        ("rox-block", &["ReadOnlyMany"][..], true),
        ("rwo", &["ReadWriteOnce"][..], false),
        ("rwo-rox", &["ReadWriteOnce", "ReadOnlyMany"][..], false),
    ] {
        let mut b = pvc("app", name).access_modes(modes).request("16Mi").class("loop");
        if block {
            b = b.block();
        }
        let c = h.create_pvc(b.build()).await;
        h.claim_phase("app", name, "Bound").await;
        let handle = format!("pvc-{}", c.metadata.uid.clone().unwrap());
        images.insert(
            name,
            (handle.clone(), h.images.path().join(format!("{handle}.img"))),
        );
    }
    assert_eq!(fs_on(&images["rox"].1).as_deref(), Some("ext4"));
    for blank in ["rox-block", "rwo", "rwo-rox"] {
        assert_eq!(fs_on(&images[blank].1), None, "{blank} is left to the node");
    }

    // What a node's stage of it does, read-only as every stage of a ReadOnlyMany volume is: a
    // read-only loop device, the file system found (never formatted), mounted read-only.
    use stowage_loopdriver::sys;
    let image = &images["rox"].1;
    let dev = sys::loop_attach(image, true).await.expect("losetup -r");
    let found = sys::probe(&dev).await;
    let target = tempfile::tempdir().unwrap();
    let mounted = sys::mount_device(&dev, target.path(), true).await;
    let listing = std::fs::read_dir(target.path()).map(|d| d.count()).unwrap_or(0);
    if mounted.is_ok() {
        sys::unmount(target.path(), false).await.unwrap();
    }
    sys::loop_detach(&dev).await.unwrap();
    assert_eq!(found.unwrap(), sys::Probe::Found("ext4".into()));
    mounted.expect("mounts read-only");
    assert!(listing > 0, "the mounted file system shows (lost+found)");
}

/// What a kube-controller-manager dashboard reads, after a built-in provisioning and deletion:
/// the end-to-end `volume_operation_total_seconds` under the provisioner's name, the attempts in
/// `storage_operation_duration_seconds` under the CSI plugin's (KCM's buckets), and the one
/// queue's keys under KCM's queue names `claims` and `volumes`.
#[tokio::test]
async fn provisioning_and_deletion_show_in_kube_controller_managers_metrics() {
    let h = Harness::start().await;
    stowage_common::observe::storageops::register_metrics(&h.registry);
    stowage_common::runtime::queue::register_metrics(&h.registry);
    h.namespace("app").await;
    h.create::<StorageClass>(storage_class("loop", "loop.stowage.dev").build())
        .await;
    let c = h
        .create_pvc(pvc("app", "kcm").request("16Mi").class("loop").build())
        .await;
    h.claim_phase("app", "kcm", "Bound").await;
    let name = format!("pvc-{}", c.metadata.uid.clone().unwrap());
    h.delete_claim("app", "kcm").await;
    // Once the binder has deleted it, what pv-protection would do: let the object go.
    eventually(WAIT, || async {
        match h.pvs().get_opt(&name).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(v) if v.metadata.deletion_timestamp.is_some() => {
                h.delete_volume(&name).await;
                Err("volume being deleted".to_string())
            }
            Some(_) => Err("volume still there".to_string()),
        }
    })
    .await;

    let csi = "kubernetes.io/csi:loop.stowage.dev";
    let m = eventually(WAIT, || async {
        let m = stowage_testkit::scrape::parse(&h.metrics_text()).map_err(|e| e.to_string())?;
        let count = |name: &str, labels: &[(&str, &str)]| m.sum_where(name, labels);
        let missing: Vec<String> = [
            (
                "volume_operation_total_seconds_count",
                vec![
                    ("plugin_name", "loop.stowage.dev"),
                    ("operation_name", "provision"),
                ],
            ),
            (
                "volume_operation_total_seconds_count",
                vec![("plugin_name", "loop.stowage.dev"), ("operation_name", "delete")],
            ),
            (
                "storage_operation_duration_seconds_count",
                vec![
                    ("volume_plugin", csi),
                    ("operation_name", "volume_provision"),
                    ("status", "success"),
                    ("migrated", "false"),
                ],
            ),
            (
                "storage_operation_duration_seconds_count",
                vec![
                    ("volume_plugin", csi),
                    ("operation_name", "volume_delete"),
                    ("status", "success"),
                    ("migrated", "false"),
                ],
            ),
            ("workqueue_adds_total", vec![("name", "claims")]),
            ("workqueue_adds_total", vec![("name", "volumes")]),
        ]
        .into_iter()
        .filter(|(n, l)| count(n, l) < 1.0)
        .map(|(n, l)| format!("{n}{l:?}"))
        .collect();
        if missing.is_empty() {
            Ok(m)
        } else {
            Err(format!("no series yet: {missing:?}"))
        }
    })
    .await;
    assert!(
        m.samples["workqueue_adds_total"]
            .iter()
            .all(|(l, _)| l["name"] != "binder"),
        "the binder's queue reports only under KCM's names"
    );
    let mut bounds: Vec<String> = m.samples["storage_operation_duration_seconds_bucket"]
        .iter()
        .filter(|(l, _)| l["operation_name"] == "volume_provision" && l["status"] == "success")
        .map(|(l, _)| l["le"].clone())
        .collect();
    bounds.dedup();
    assert_eq!(
        bounds,
        [
            "0.1", "0.25", "0.5", "1", "2.5", "5", "10", "15", "25", "50", "120", "300", "600", "+Inf"
        ],
        "KCM's buckets"
    );
}

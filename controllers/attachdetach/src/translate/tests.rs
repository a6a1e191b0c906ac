use k8s_openapi::api::core::v1::{self as v1, PersistentVolume, PersistentVolumeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use proptest::prelude::*;
use stowage_common::store::StoredVolume;

use super::*;

fn view(labels: &[(&str, &str)], spec: PersistentVolumeSpec) -> VolumeSource {
    let pv = PersistentVolume {
        metadata: ObjectMeta {
            name: Some("pv".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(spec),
        ..Default::default()
    };
    StoredVolume::new(pv).source().expect("reads back")
}

fn target(labels: &[(&str, &str)], spec: PersistentVolumeSpec) -> Target {
    pv_target("pv", &view(labels, spec))
        .expect("translates")
        .expect("attachable")
}

fn rwo() -> Option<Vec<String>> {
    Some(vec!["ReadWriteOnce".into()])
}

#[test]
fn migrated_pvs_go_to_their_csi_driver_with_the_translated_handle() {
    let ebs = target(
        &[],
        PersistentVolumeSpec {
            access_modes: rwo(),
            aws_elastic_block_store: Some(v1::AWSElasticBlockStoreVolumeSource {
                volume_id: "aws://us-east-1a/vol-0123".into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(
        (ebs.driver.as_str(), ebs.handle.as_str()),
        ("ebs.csi.aws.com", "vol-0123")
    );
    assert_eq!(ebs.unique_name(), "kubernetes.io/csi/ebs.csi.aws.com^vol-0123");
    assert_eq!(ebs.kind, Kind::Csi);
    assert!(!ebs.multi_attach);

    let pd = |labels: &[(&str, &str)]| {
        target(
            labels,
            PersistentVolumeSpec {
                access_modes: Some(vec!["ReadWriteMany".into()]),
                gce_persistent_disk: Some(v1::GCEPersistentDiskVolumeSource {
                    pd_name: "disk-1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    };
    assert_eq!(
        pd(&[]).handle,
        "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/disk-1"
    );
    assert_eq!(
        pd(&[("topology.kubernetes.io/zone", "europe-west1-b")]).handle,
        "projects/UNSPECIFIED/zones/europe-west1-b/disks/disk-1"
    );
    assert_eq!(
        pd(&[(
            "failure-domain.beta.kubernetes.io/zone",
            "us-central1-a__us-central1-b"
        )])
        .handle,
        "projects/UNSPECIFIED/regions/us-central1/disks/disk-1"
    );
    // ReadWriteMany was ReadWriteOnce for PD in-tree, and the CSI spec says so.
    assert!(!pd(&[]).multi_attach);

    let cinder = target(
        &[],
        PersistentVolumeSpec {
            cinder: Some(v1::CinderPersistentVolumeSource {
                volume_id: "c-1".into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(
        (cinder.driver.as_str(), cinder.handle.as_str()),
        ("cinder.csi.openstack.org", "c-1")
    );

    let azure = pv_target(
        "pv",
        &view(
            &[],
            PersistentVolumeSpec {
                azure_disk: Some(v1::AzureDiskVolumeSource {
                    disk_uri: "/subscriptions/s/disks/d".into(),
                    disk_name: "d".into(),
                    kind: Some("Shared".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
    );
    assert!(azure.is_err(), "only managed disks translate");
}

#[test]
fn iscsi_and_fc_are_named_as_their_plugins_name_them() {
    let iscsi = target(
        &[],
        PersistentVolumeSpec {
            access_modes: rwo(),
            iscsi: Some(v1::ISCSIPersistentVolumeSource {
                target_portal: "10.0.0.1:3260".into(),
                iqn: "iqn.2001-04.com.example:storage.disk1".into(),
                lun: 3,
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(iscsi.kind, Kind::InTree);
    assert_eq!(
        iscsi.unique_name(),
        "kubernetes.io/iscsi/10.0.0.1:3260:iqn.2001-04.com.example:storage.disk1:3"
    );
    let fc = target(
        &[],
        PersistentVolumeSpec {
            fc: Some(v1::FCVolumeSource {
                target_wwns: Some(vec!["500a0981891b8dc5".into(), "500a0981991b8dc5".into()]),
                lun: Some(0),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(
        fc.unique_name(),
        "kubernetes.io/fc/[500a0981891b8dc5 500a0981991b8dc5]:0"
    );
    let wwids = target(
        &[],
        PersistentVolumeSpec {
            fc: Some(v1::FCVolumeSource {
                wwids: Some(vec!["3600508b400105e210000900000490000".into()]),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(
        wwids.unique_name(),
        "kubernetes.io/fc/[3600508b400105e210000900000490000]"
    );
    assert_eq!(
        split_in_tree_name(&iscsi.unique_name()),
        Some((ISCSI_PLUGIN, iscsi.handle.as_str()))
    );
    // Volumes that need no attaching.
    let nfs = view(
        &[],
        PersistentVolumeSpec {
            nfs: Some(v1::NFSVolumeSource {
                server: "s".into(),
                path: "/".into(),
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    assert_eq!(pv_target("pv", &nfs), Ok(None));
}

fn inline(json: serde_json::Value) -> PodVolume {
    serde_json::from_value(json).expect("a pod volume")
}

#[test]
fn inline_volumes_carry_the_translated_spec() {
    let v = inline(serde_json::json!({
        "name": "data",
        "awsElasticBlockStore": { "volumeID": "vol-42", "fsType": "ext4" }
    }));
    let t = inline_target(&v, "app").unwrap().unwrap();
    assert_eq!(t.pv_name, "ebs.csi.aws.com-vol-42");
    assert_eq!(t.unique_name(), "kubernetes.io/csi/ebs.csi.aws.com^vol-42");
    assert!(!t.multi_attach);
    let Kind::Inline(spec) = &t.kind else {
        panic!("inline")
    };
    let json = serde_json::to_value(&spec.0).unwrap();
    assert_eq!(
        json,
        serde_json::json!({
            "accessModes": ["ReadWriteOnce"],
            "csi": {
                "driver": "ebs.csi.aws.com",
                "volumeHandle": "vol-42",
                "fsType": "ext4",
                "volumeAttributes": { "partition": "0" }
            },
            "volumeMode": "Filesystem"
        })
    );
    // A read-only PD is shared.
    let pd = inline(serde_json::json!({
        "name": "d", "gcePersistentDisk": { "pdName": "p", "readOnly": true }
    }));
    assert!(inline_target(&pd, "app").unwrap().unwrap().multi_attach);
    // Inline iSCSI: attached in-tree, shareable (upstream knows nothing of its modes).
    let iscsi = inline(serde_json::json!({
        "name": "i", "iscsi": { "targetPortal": "t:3260", "iqn": "iqn.x", "lun": 1 }
    }));
    let t = inline_target(&iscsi, "app").unwrap().unwrap();
    assert_eq!(t.unique_name(), "kubernetes.io/iscsi/t:3260:iqn.x:1");
    assert_eq!(t.kind, Kind::InTree);
    let empty = inline(serde_json::json!({ "name": "e", "emptyDir": {} }));
    assert_eq!(inline_target(&empty, "app"), Ok(None));
}

#[test]
fn azure_file_handles_name_the_account_share_and_namespace() {
    let v = inline(serde_json::json!({
        "name": "files",
        "azureFile": { "secretName": "azure-storage-account-acct-secret", "shareName": "share" }
    }));
    let t = inline_target(&v, "app").unwrap().unwrap();
    assert_eq!(t.handle, "#acct#share#files#app");
    assert!(t.multi_attach);
    assert_eq!(azure_account("plain"), "plain");
}

proptest! {
    /// The kinds of unique names never overlap: a CSI name is never taken for iSCSI/FC, and
    /// whatever is neither is not managed.
    #[test]
    fn unique_name_kinds_are_disjoint(name in "(kubernetes\\.io/(csi|iscsi|fc|aws-ebs)/)?[a-z^:/\\[\\] ]{0,12}") {
        let csi = is_csi_name(&name);
        let in_tree = split_in_tree_name(&name).is_some();
        prop_assert!(!(csi && in_tree));
        if !csi && !in_tree {
            prop_assert!(!is_managed_name(&name) || crate::read::split_unique_volume_name(&name).is_some());
        }
    }
}

proptest! {
    /// Whatever the source, a target's unique name is one the controller manages, of the kind
    /// its attach needs, and splits back into the driver (or plugin) and handle it was made of:
    /// what node status and the actual state key on stays consistent with what was attached.
    #[test]
    fn targets_name_themselves_consistently(
        id in "[a-z0-9]{1,8}",
        zone in proptest::option::of("[a-z]{2}-[a-z]{4}[0-9]-[a-c]"),
        lun in 0..256i32,
        which in 0..5usize,
    ) {
        let mut spec = PersistentVolumeSpec::default();
        let mut labels = Vec::new();
        match which {
            0 => spec.aws_elastic_block_store = Some(v1::AWSElasticBlockStoreVolumeSource {
                volume_id: format!("aws://zone/vol-{id}"),
                ..Default::default()
            }),
            1 => {
                spec.gce_persistent_disk = Some(v1::GCEPersistentDiskVolumeSource {
                    pd_name: id.clone(),
                    ..Default::default()
                });
                if let Some(z) = &zone {
                    labels.push(("topology.kubernetes.io/zone", z.as_str()));
                }
            }
            2 => spec.cinder = Some(v1::CinderPersistentVolumeSource {
                volume_id: id.clone(),
                ..Default::default()
            }),
            3 => spec.iscsi = Some(v1::ISCSIPersistentVolumeSource {
                target_portal: format!("10.0.0.1:{lun}"),
                iqn: format!("iqn.2001-04.com.example:{id}"),
                lun,
                ..Default::default()
            }),
            _ => spec.fc = Some(v1::FCVolumeSource {
                target_wwns: Some(vec![id.clone()]),
                lun: Some(lun),
                ..Default::default()
            }),
        }
        let t = target(&labels, spec);
        let name = t.unique_name();
        prop_assert!(is_managed_name(&name));
        match t.kind {
            Kind::InTree => {
                prop_assert!(!is_csi_name(&name));
                prop_assert_eq!(split_in_tree_name(&name), Some((t.driver.as_str(), t.handle.as_str())));
            }
            _ => {
                prop_assert!(is_csi_name(&name));
                prop_assert_eq!(
                    crate::read::split_unique_volume_name(&name),
                    Some((t.driver.as_str(), t.handle.as_str()))
                );
            }
        }
    }
}

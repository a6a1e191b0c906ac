//! Local mode (`--image-store-mode=local`) on a real apiserver with two agents that share nothing:
//! each node has its own image store directory, as separate machines have their own disks. A
//! claim is provisioned on the node the scheduler selected (this test plays the scheduler's
//! PreBind: the selected-node annotation) and pinned to it; the image is made in that node's
//! store only; the node attaches it and grows it; a volume from another store is refused; the
//! deletion runs on the node; a node that is gone leaves its volume and its file in place; a class
//! that binds at once is provisioned on the node with the most room the agents publish, and a
//! claim no store can hold says so; the leader can move, as no replica needs a store.

use std::path::Path;

use stowage_testkit::binary::Running;
use stowage_testkit::host::{Cleanup, mounts_under};
use stowage_testkit::{ControlPlane, eventually};

mod support;
use support::{Kubectl, LIMIT, agent_bin};
const TOPOLOGY_KEY: &str = "topology.loop.stowage.dev/node";

fn apply(k: &Kubectl, dir: &Path, name: &str, yaml: &str) {
    let file = dir.join(name);
    std::fs::write(&file, yaml).unwrap();
    k.must(&["apply", "-f", &file.display().to_string()]);
}

/// Waits for an Event of `reason` on `kind/name` (any `kind` object for an empty name) whose
/// message contains `part`; returns the messages.
async fn event(k: &Kubectl, kind: &str, name: &str, reason: &str, part: &str) -> String {
    let mut selector = format!("involvedObject.kind={kind},reason={reason}");
    if !name.is_empty() {
        selector.push_str(&format!(",involvedObject.name={name}"));
    }
    let mut found = String::new();
    eventually(LIMIT, || {
        let got = k.run(&[
            "get",
            "events",
            "-A",
            "--field-selector",
            &selector,
            "-o",
            "jsonpath={.items[*].message}",
        ]);
        let ok = got.as_ref().is_ok_and(|m| m.contains(part));
        if ok {
            found = got.clone().unwrap();
        }
        async move {
            match ok {
                true => Ok(()),
                false => Err(format!(
                    "no {reason} event on {kind}/{name} containing {part:?}: {got:?}"
                )),
            }
        }
    })
    .await;
    found
}

fn claim(name: &str, class: &str, node: Option<&str>) -> String {
    let selected = node
        .map(|n| format!("  annotations: {{volume.kubernetes.io/selected-node: {n}}}\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: default\n{selected}spec:\n  storageClassName: {class}\n  accessModes: [ReadWriteOnce]\n  resources: {{requests: {{storage: 64Mi}}}}\n"
    )
}

fn pod(name: &str, node: &str, claim: &str) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"{name}","namespace":"default"}},"spec":{{"nodeName":"{node}","containers":[{{"name":"c","image":"busybox","volumeMounts":[{{"name":"d","mountPath":"/data"}}]}}],"volumes":[{{"name":"d","persistentVolumeClaim":{{"claimName":"{claim}"}}}}]}}}}"#
    )
}

fn marker_id(store: &Path) -> String {
    let text = std::fs::read_to_string(store.join(".stowage-image-store")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("id: "))
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_local_volumes_live_and_die_on_their_node() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let base = std::env::temp_dir().join(stowage_testkit::unique("stowage-local"));
    // One store per node, nothing shared; each agent marks its own (no install step).
    let store = |n: &str| base.join(n).join("images");
    for n in ["node-a", "node-b"] {
        std::fs::create_dir_all(store(n)).unwrap();
    }
    // Dropped last: the loop devices over either store are released and the dirs removed.
    let _cleanup = [
        Cleanup {
            base: base.join("node-a"),
            images: store("node-a"),
        },
        Cleanup {
            base: base.clone(),
            images: store("node-b"),
        },
    ];
    let kc = cp.kubeconfig();
    // No store for the controller: a path that does not exist proves it never looks. Any replica
    // can lead, wherever it runs.
    let controller = |name: &str| {
        Running::start(
            Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
            &[
                format!("--kubeconfig={}", kc.display()),
                "--leader-elect-resource-namespace=default".into(),
                format!("--leader-elect-identity={name}"),
                "--image-store-mode=local".into(),
                format!("--image-dir={}", base.join("no-store").display()),
            ],
            &base,
            name,
        )
        .unwrap()
    };
    let ctl = controller("replica-1");
    let mut agents = Vec::new();
    for n in ["node-a", "node-b"] {
        agents.push(Some(
            Running::start(
                &agent_bin(),
                &[
                    format!("--kubeconfig={}", kc.display()),
                    format!("--node-name={n}"),
                    format!("--root-dir={}", base.join(n).display()),
                    format!("--image-dir={}", store(n).display()),
                    "--image-store-mode=local".into(),
                    "--capacity-namespace=default".into(),
                    "--register-node".into(),
                ],
                &base,
                n,
            )
            .unwrap(),
        ));
    }
    let k = Kubectl(kc.clone());
    // Each node is labelled with its topology, as a kubelet does from NodeGetInfo.
    let label = "jsonpath={.items[*].metadata.labels.topology\\.loop\\.stowage\\.dev/node}";
    k.until(&["get", "nodes", "-o", label], "node-a node-b").await;
    apply(
        &k,
        &base,
        "storage.yaml",
        r#"apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {name: loop.stowage.dev}
spec: {attachRequired: true, podInfoOnMount: false}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local}
provisioner: loop.stowage.dev
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
allowVolumeExpansion: true
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: now}
provisioner: loop.stowage.dev
reclaimPolicy: Delete
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: default, namespace: default}
"#,
    );

    // Provisioned on the selected node, pinned to it, its image in that node's store only.
    apply(&k, &base, "b.yaml", &claim("on-b", "local", Some("node-b")));
    let phase = |c: &str| ["get", "pvc", c, "-o", "jsonpath={.status.phase}"].map(String::from);
    let args = phase("on-b");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    k.until(&args, "Bound").await;
    let pv = k.must(&["get", "pvc", "on-b", "-o", "jsonpath={.spec.volumeName}"]);
    let pv = pv.trim().to_string();
    let affinity = k.must(&[
        "get",
        "pv",
        &pv,
        "-o",
        "jsonpath={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].key}={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}",
    ]);
    assert_eq!(affinity.trim(), format!("{TOPOLOGY_KEY}=node-b"));
    let image = format!("{pv}.img");
    assert!(store("node-b").join(&image).is_file(), "image made on node-b");
    assert!(!store("node-a").join(&image).exists(), "nothing on node-a");
    let recorded = k.must(&[
        "get",
        "pv",
        &pv,
        "-o",
        "jsonpath={.metadata.annotations.loop\\.stowage\\.dev/store-id}",
    ]);
    assert_eq!(
        recorded.trim(),
        marker_id(&store("node-b")),
        "the store id is recorded"
    );
    event(
        &k,
        "PersistentVolumeClaim",
        "on-b",
        "ProvisioningSucceeded",
        "node-b",
    )
    .await;

    // Grown on its node: the controller records the size, and node-b grows the image and the
    // file system when it mounts the volume (offline: online ext4 growth is not allowed
    // everywhere these tests run).
    k.must(&[
        "patch",
        "pvc",
        "on-b",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ]);
    k.until(
        &[
            "get",
            "pvc",
            "on-b",
            "-o",
            "jsonpath={.status.allocatedResourceStatuses.storage}",
        ],
        "NodeResizePending",
    )
    .await;
    // The node grows the image as soon as the new size is recorded, with no pod yet; nothing
    // appears in the other node's store.
    let grown = store("node-b").join(&image);
    eventually(LIMIT, || async {
        match std::fs::metadata(&grown).map(|m| m.len()) {
            Ok(n) if n == 128 << 20 => Ok(()),
            other => Err(format!("image on node-b: {other:?}, want {} bytes", 128 << 20)),
        }
    })
    .await;
    assert!(!store("node-a").join(&image).exists());

    // Attached, grown and mounted on its node.
    apply(&k, &base, "pod-b.json", &pod("user-b", "node-b", "on-b"));
    let attached = [
        "get",
        "volumeattachments",
        "-o",
        "jsonpath={.items[*].status.attached}",
    ];
    k.until(&attached, "true").await;
    let uid = k.must(&["get", "pod", "user-b", "-o", "jsonpath={.metadata.uid}"]);
    let dir = base.join("node-b").join("pods").join(uid.trim()).join("volumes");
    eventually(LIMIT, || async {
        match mounts_under(&dir).is_empty() {
            true => Err(format!("no mount under {}", dir.display())),
            false => Ok(()),
        }
    })
    .await;

    k.until(
        &["get", "pvc", "on-b", "-o", "jsonpath={.status.capacity.storage}"],
        "128Mi",
    )
    .await;
    assert_eq!(
        std::fs::metadata(store("node-b").join(&image)).unwrap().len(),
        128 << 20,
        "the image grew on node-b"
    );

    // A volume whose image was made in another store is refused, its file left alone.
    let foreign = store("node-a").join("foreign.img");
    std::fs::File::create(&foreign)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    apply(
        &k,
        &base,
        "foreign.yaml",
        r#"apiVersion: v1
kind: PersistentVolume
metadata:
  name: foreign
  annotations: {loop.stowage.dev/store-id: 0123456789abcdef0123456789abcdef}
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  claimRef: {namespace: default, name: foreign}
  csi: {driver: loop.stowage.dev, volumeHandle: foreign, fsType: ext4}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: foreign, namespace: default}
spec:
  storageClassName: ""
  volumeName: foreign
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 64Mi}}
"#,
    );
    apply(
        &k,
        &base,
        "pod-foreign.json",
        &pod("user-foreign", "node-a", "foreign"),
    );
    let va = event(
        &k,
        "VolumeAttachment",
        "",
        "FailedAttach",
        "0123456789abcdef0123456789abcdef",
    )
    .await;
    assert!(va.contains("nothing is attached or deleted"), "{va}");
    assert_eq!(std::fs::metadata(&foreign).unwrap().len(), 64 << 20);

    // Deletion runs on the node that holds the image.
    k.must(&["delete", "pod", "user-b", "--grace-period=0", "--force"]);
    k.until(
        &[
            "get",
            "volumeattachments",
            "-o",
            &format!("jsonpath={{.items[?(@.spec.source.persistentVolumeName==\"{pv}\")].metadata.name}}"),
        ],
        "",
    )
    .await;
    k.must(&["delete", "pvc", "on-b"]);
    k.until(&["get", "pv", &pv, "--ignore-not-found", "-o", "name"], "")
        .await;
    assert!(!store("node-b").join(&image).exists(), "node-b deleted the image");

    // The leader goes; another replica (elsewhere, with no store either) takes over and the
    // same work goes on: provisioning below, deletion and the node-gone check after it.
    drop(ctl);
    let ctl = controller("replica-2");
    k.until(
        &[
            "get",
            "lease",
            "-n",
            "default",
            "stowage-controller",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ],
        "replica-2",
    )
    .await;

    // A class that binds at once: made on the node whose store has the most room (from the
    // agents' CSIStorageCapacity objects, one per class and node), pinned there.
    let published = "jsonpath={range .items[?(@.storageClassName==\"now\")]}{.nodeTopology.matchLabels.topology\\.loop\\.stowage\\.dev/node} {end}";
    k.until(
        &["get", "csistoragecapacities", "-n", "default", "-o", published],
        "node-a node-b",
    )
    .await;
    // An object deleted by hand is published again (the agent watches its own objects).
    let name_a = "jsonpath={.items[?(@.metadata.labels.topology\\.loop\\.stowage\\.dev/node==\"node-a\")].metadata.name}";
    let ours = k.must(&["get", "csistoragecapacities", "-n", "default", "-o", name_a]);
    let ours: Vec<&str> = ours.split_whitespace().collect();
    assert!(!ours.is_empty(), "node-a publishes its store");
    let mut del = vec!["delete", "csistoragecapacities", "-n", "default"];
    del.extend(&ours);
    k.must(&del);
    k.until(
        &["get", "csistoragecapacities", "-n", "default", "-o", name_a],
        &ours.join(" "),
    )
    .await;
    apply(&k, &base, "now.yaml", &claim("now", "now", None));
    let args = phase("now");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    k.until(&args, "Bound").await;
    let pv_now = k.must(&["get", "pvc", "now", "-o", "jsonpath={.spec.volumeName}"]);
    let pv_now = pv_now.trim().to_string();
    let node_now = k.must(&[
        "get",
        "pv",
        &pv_now,
        "-o",
        "jsonpath={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}",
    ]);
    let node_now = node_now.trim();
    assert!(
        store(node_now).join(format!("{pv_now}.img")).is_file(),
        "{pv_now} made in the store of {node_now}, the node it is pinned to"
    );
    // Each binary signs its writes: the controller made and bound the PV, the agent recorded the
    // image it made.
    let managers = k.must(&[
        "get",
        "pv",
        &pv_now,
        "-o",
        "jsonpath={.metadata.managedFields[*].manager}",
    ]);
    let managers: Vec<&str> = managers.split_whitespace().collect();
    assert!(
        managers.contains(&"stowage-controller") && managers.contains(&"stowage-agent"),
        "{managers:?}"
    );
    assert!(!managers.contains(&"unknown"), "{managers:?}");
    // More than any store has: Pending, and the claim says why.
    apply(
        &k,
        &base,
        "huge.yaml",
        &claim("huge", "now", None).replace("64Mi", "100Ti"),
    );
    event(
        &k,
        "PersistentVolumeClaim",
        "huge",
        "ProvisioningFailed",
        "no node's image store has room",
    )
    .await;
    let args = phase("huge");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    k.until(&args, "Pending").await;

    // A node that is gone: its volume stays Released with a Warning naming it, its file in place.
    apply(&k, &base, "a.yaml", &claim("on-a", "local", Some("node-a")));
    let args = phase("on-a");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    k.until(&args, "Bound").await;
    let pv_a = k.must(&["get", "pvc", "on-a", "-o", "jsonpath={.spec.volumeName}"]);
    let pv_a = pv_a.trim().to_string();
    let image_a = store("node-a").join(format!("{pv_a}.img"));
    assert!(image_a.is_file());
    agents[0].take();
    k.must(&["delete", "node", "node-a"]);
    k.must(&["delete", "pvc", "on-a"]);
    event(&k, "PersistentVolume", &pv_a, "VolumeNodeGone", "node-a").await;
    k.until(
        &["get", "pv", &pv_a, "-o", "jsonpath={.status.phase}"],
        "Released",
    )
    .await;
    assert!(
        image_a.is_file(),
        "the gone node's file is never deleted in its absence"
    );
    // The second replica led to the end; it stops before the stores are cleaned up.
    drop(ctl);
}

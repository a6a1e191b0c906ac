//! Local mode on two real nodes that share no store: `realnode` keeps the store path of the host,
//! `realnode2` has a directory of its own bound there in its mount namespace, as two machines
//! have two disks. stowage is installed by helm with the chart's default mode (local), the real
//! kube-scheduler places the pods, and the kubelets learn the driver's topology from NodeGetInfo.
//!
//! - Claims are created together with their pods (one `kubectl apply` each, as a StatefulSet does),
//!   several times on each node: not one FailedScheduling event (the binder writes nothing the
//!   scheduler's PreBind could conflict with).
//! - Each volume is made in the store of the node its pod was scheduled to, pinned there, and its
//!   store's id recorded; a second pod of the claim, free to go anywhere, is scheduled to that
//!   node and reads what the first wrote.
//! - Capacity: node 1's store is a small file system (a 512 MiB tmpfs), so a claim bigger than
//!   what it has left is provisioned on node 2 (the scheduler reads the agents'
//!   CSIStorageCapacity objects), and a claim no store can hold stays Pending, its pod's
//!   FailedScheduling saying there is not enough free storage.
//! - Deleting the claims deletes each image from its own node's store.
//!
//! Needs root and the archives `make test` builds, like the other real-node scenarios.

use std::time::{Duration, Instant};

use stowage_chart_tests::Helm;
use stowage_testkit::host::Cleanup;
use stowage_testkit::realnode::{NODE_NAME, NODE2_NAME, RealNode};
use support::{Kubectl, NS, archives, control_plane, install_mode, marker_id};

// The single-node scenarios' helpers; not all of them are used here.
#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;

const TOPOLOGY_KEY: &str = "topology.loop.stowage.dev/node";

/// A claim of the chart's WaitForFirstConsumer class and a pod for it, in one document: the pod
/// asks for `node` (through the scheduler; anywhere for `None`), writes its name, and stays.
fn claim_with_pod(name: &str, node: Option<&str>, size: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: {NS}}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: loop
  resources: {{requests: {{storage: {size}}}}}
---
{}"#,
        pod(name, node, name)
    )
}

fn pod(name: &str, node: Option<&str>, claim: &str) -> String {
    support::writer_pod(name, claim, node)
}

#[tokio::test(flavor = "multi_thread")]
async fn node_local_volumes_on_two_real_nodes() {
    let started = Instant::now();
    let archives = archives();
    let (cp, images, _cleanup) = control_plane(2).await;
    // Node 2's own store, under its node dir; its loop devices are released before the dir goes.
    let store2 = std::fs::canonicalize(cp.dir())
        .unwrap()
        .join("realnode2")
        .join("images");
    let _cleanup2 = Cleanup {
        base: store2.clone(),
        images: store2.clone(),
    };
    // Node 1's disk is small: a tmpfs at its store path (the guard unmounts it with the store).
    // Mounted before the nodes start: node 1's mount namespace is a copy of the host's made then
    // (this machine's `/` is private, so a later host mount would not reach it).
    let small = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=512m", "tmpfs"])
        .arg(&images)
        .status()
        .unwrap();
    assert!(small.success(), "mount a tmpfs at {}", images.display());
    let cluster = RealNode::start_cluster(&cp, &archives, 2).unwrap_or_else(|e| panic!("real nodes: {e:#}"));
    let (node1, node2) = (&cluster[0], &cluster[1]);
    let stores = [
        (NODE_NAME, node1.image_store(&images, true).unwrap()),
        (NODE2_NAME, node2.image_store(&images, true).unwrap()),
    ];
    println!("real nodes up after {:?}; stores {stores:?}", started.elapsed());
    let k = Kubectl {
        kubeconfig: cp.kubeconfig(),
    };
    let helm = Helm::new(Some(&cp.kubeconfig()));
    install_mode(&helm, &k, &cp, &images, &node1.kubelet_dir, "local", || {
        format!("{}\n{}", node1.log_tail("kubelet"), node2.log_tail("kubelet"))
    })
    .await;
    // Each kubelet registered the plugin with its topology: the key in CSINode, the label on
    // the Node.
    for node in [NODE_NAME, NODE2_NAME] {
        k.wait(
            &["csinode", node],
            "{.spec.drivers[*].topologyKeys[*]}",
            TOPOLOGY_KEY,
        );
        k.wait(
            &["node", node],
            "{.metadata.labels.topology\\.loop\\.stowage\\.dev/node}",
            node,
        );
    }
    k.show("installed in local mode on two nodes");
    // Each agent marks its own store when its image loop starts, which may be a moment after its
    // pod is Running: two stores, two ids.
    let ids = stowage_testkit::eventually(Duration::from_secs(60), || async {
        let ids = [marker_id(&stores[0].1), marker_id(&stores[1].1)];
        if ids.iter().all(|id| !id.is_empty()) {
            Ok(ids)
        } else {
            Err(format!("store markers {ids:?}"))
        }
    })
    .await;
    assert_ne!(ids[0], ids[1], "{ids:?}");

    // Claims created with their pods, three on each node.
    let names: Vec<(String, &str)> = (0..6)
        .map(|i| (format!("d{i}"), if i % 2 == 0 { NODE_NAME } else { NODE2_NAME }))
        .collect();
    for (name, node) in &names {
        k.apply(&claim_with_pod(name, Some(node), "64Mi"));
    }
    for (name, _) in &names {
        k.wait(&["pod", "-n", NS, name], "{.status.phase}", "Running");
        k.wait_logs(name, &format!("wrote {name}"));
    }
    k.show("six claims created with their pods");
    let unscheduled = k.event_objects("FailedScheduling");
    assert!(
        unscheduled.trim().is_empty(),
        "claims created with their pods made the scheduler fail: {unscheduled}"
    );
    // (checked before the capacity step below, whose impossible claim fails on purpose)

    for (name, node) in &names {
        let pv = k.volume_of(name);
        let pinned = k.must(&[
            "get",
            "pv",
            &pv,
            "-o",
            "jsonpath={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}",
        ]);
        assert_eq!(pinned.trim(), *node, "{pv} pinned to its pod's node");
        let (own, other) = match *node == NODE_NAME {
            true => (&stores[0], &stores[1]),
            false => (&stores[1], &stores[0]),
        };
        let image = format!("{pv}.img");
        assert!(own.1.join(&image).is_file(), "{image} in {}'s store", own.0);
        assert!(
            !other.1.join(&image).exists(),
            "{image} not in {}'s store",
            other.0
        );
        let id = k.must(&[
            "get",
            "pv",
            &pv,
            "-o",
            "jsonpath={.metadata.annotations.loop\\.stowage\\.dev/store-id}",
        ]);
        assert_eq!(id.trim(), marker_id(&own.1), "{pv} records its store");
    }

    // Each agent publishes its store's capacity for the chart's class, for its own node.
    let published = "{range .items[?(@.storageClassName==\"loop\")]}{.nodeTopology.matchLabels.topology\\.loop\\.stowage\\.dev/node} {end}";
    k.wait(
        &["csistoragecapacities", "-n", "stowage"],
        published,
        &format!("{NODE_NAME} {NODE2_NAME}"),
    );
    let room = |node: &str| -> u64 {
        let jp = format!(
            "{{.items[?(@.nodeTopology.matchLabels.topology\\.loop\\.stowage\\.dev/node==\"{node}\")].capacity}}"
        );
        let q = k.must(&[
            "get",
            "csistoragecapacities",
            "-n",
            "stowage",
            "-o",
            &format!("jsonpath={jp}"),
        ]);
        q.trim()
            .parse()
            .unwrap_or_else(|_| panic!("capacity of {node}: {q:?}"))
    };
    let (room1, room2) = (room(NODE_NAME), room(NODE2_NAME));
    println!("published capacity: {NODE_NAME} {room1}, {NODE2_NAME} {room2}");
    assert!(room1 < 512 << 20, "node 1's small store: {room1}");
    assert!(room2 > 1 << 30, "node 2's store: {room2}");

    // Bigger than node 1's store can still hold: made on node 2, where it fits.
    k.apply(&claim_with_pod("big", None, "400Mi"));
    k.wait(&["pod", "-n", NS, "big"], "{.status.phase}", "Running");
    k.wait(&["pod", "-n", NS, "big"], "{.spec.nodeName}", NODE2_NAME);
    let big = k.volume_of("big");
    assert!(stores[1].1.join(format!("{big}.img")).is_file());
    // Bigger than any store: Pending, and the scheduler says why.
    k.apply(&claim_with_pod("huge", None, "100Ti"));
    support::poll(|| {
        let events = k.events("involvedObject.name=huge,reason=FailedScheduling", "message");
        match events.contains("did not have enough free storage") {
            true => Ok(()),
            false => Err(format!("huge's FailedScheduling: {events:?}")),
        }
    });
    k.wait(&["pvc", "-n", NS, "huge"], "{.status.phase}", "Pending");
    k.show("capacity: big went to the node with room, huge fits nowhere");
    k.must(&["delete", "pod", "-n", NS, "big", "huge", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "big", "huge", "--wait=false"]);
    k.wait_gone(&["pv", &big]);
    assert!(!stores[1].1.join(format!("{big}.img")).exists());

    // A second pod of a claim, free to go anywhere, goes where the volume is.
    for (claim, node) in [("d1", NODE2_NAME), ("d2", NODE_NAME)] {
        let second = format!("{claim}-again");
        k.apply(&pod(&second, None, claim));
        k.wait(&["pod", "-n", NS, &second], "{.status.phase}", "Running");
        k.wait(&["pod", "-n", NS, &second], "{.spec.nodeName}", node);
        k.wait_logs(&second, &format!("have: {claim} "));
        k.must(&["delete", "pod", "-n", NS, &second, "--wait=true"]);
    }
    k.show("second pods scheduled to their volumes' nodes");

    // Deleting the claims deletes each image on its node.
    let mut gone = vec![];
    for (name, node) in &names {
        let pv = k.volume_of(name);
        k.must(&["delete", "pod", "-n", NS, name, "--wait=false"]);
        k.must(&["delete", "pvc", "-n", NS, name, "--wait=false"]);
        gone.push((pv, *node));
    }
    for (pv, node) in &gone {
        k.wait_gone(&["pv", pv]);
        let store = if *node == NODE_NAME {
            &stores[0].1
        } else {
            &stores[1].1
        };
        assert!(
            !store.join(format!("{pv}.img")).exists(),
            "{pv}'s image deleted on {node}"
        );
    }
    k.show("claims deleted; images deleted on their nodes");
    println!("local-mode scenarios: {:?}", started.elapsed());
}

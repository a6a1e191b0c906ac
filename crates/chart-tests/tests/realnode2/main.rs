//! stowage on two real nodes (`RealNode::start_cluster`): `realnode` in the host's namespaces
//! and `realnode2` in network and mount namespaces of its own, the chart installed once by helm
//! (one agent DaemonSet with one `agent.kubeletDir`, both on the host network). A claim moves
//! between the nodes with its data (the VolumeAttachment follows the pod), and a second node's
//! pod asking for a claim attached elsewhere gets the Multi-Attach event. Each step prints
//! `kubectl get pv,pvc,volumeattachment,pod`.
//!
//! Needs root and the archives `make test` builds, like the single-node scenarios.

use std::time::Instant;

use stowage_chart_tests::Helm;
use stowage_testkit::realnode::{BUSYBOX_IMAGE, NODE_NAME, NODE2_NAME, RealNode};
use support::{Kubectl, NS, archives, claim, control_plane, install, poll};

// The single-node scenarios' helpers; not all of them are used here.
#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;

/// A pod pinned to `node` (through the scheduler, which WaitForFirstConsumer needs) that prints
/// what the claim holds, then appends its own name to it.
fn pod_on(name: &str, node: &str, claim: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}}}
spec:
  terminationGracePeriodSeconds: 1
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  containers:
  - name: c
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: [sh, -c, 'echo "have: $(cat /data/f 2>/dev/null | tr "\n" " ")"; echo {name} >> /data/f && sync && echo "wrote {name}"; sleep 3600']
    volumeMounts: [{{name: v, mountPath: /data}}]
  volumes: [{{name: v, persistentVolumeClaim: {{claimName: {claim}}}}}]
"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kubelet_runs_pods_on_loop_volumes_across_two_nodes() {
    let started = Instant::now();
    let archives = archives();
    let (cp, images, _cleanup) = control_plane(2).await;
    let cluster = RealNode::start_cluster(&cp, &archives, 2).unwrap_or_else(|e| panic!("real nodes: {e:#}"));
    let (node1, node2) = (&cluster[0], &cluster[1]);
    println!(
        "real nodes up after {:?}: {} ({}), {} ({}, netns {:?}); apiserver for nodes at {}",
        started.elapsed(),
        node1.name,
        node1.node_ip,
        node2.name,
        node2.node_ip,
        node2.netns(),
        cp.node_url()
    );
    let k = Kubectl {
        kubeconfig: cp.kubeconfig(),
    };
    let helm = Helm::new(Some(&cp.kubeconfig()));
    install(&helm, &k, &cp, &images, &node1.kubelet_dir, || {
        format!("{}\n{}", node1.log_tail("kubelet"), node2.log_tail("kubelet"))
    })
    .await;
    // One agent per node, each registered with its own kubelet.
    for node in [NODE_NAME, NODE2_NAME] {
        k.wait(&["csinode", node], "{.spec.drivers[*].name}", "loop.stowage.dev");
    }
    k.wait(
        &["daemonset", "-n", "stowage", "st-stowage-agent"],
        "{.status.numberReady}",
        "2",
    );
    k.show("installed on two nodes");

    // a. A claim moves between the nodes with its data: written on node 1, read and added to on
    //    node 2, both read back on node 1. The attachment follows the pod, one node at a time.
    let attached_to = "{range .items[?(@.status.attached==true)]}{.spec.nodeName}{end}";
    k.apply(&claim("moving", "loop", "ReadWriteOnce"));
    k.apply(&pod_on("one", NODE_NAME, "moving"));
    k.wait(&["pod", "-n", NS, "one"], "{.status.phase}", "Running");
    k.wait_logs("one", "wrote one");
    let pv = k.must(&[
        "get",
        "pvc",
        "-n",
        NS,
        "moving",
        "-o",
        "jsonpath={.spec.volumeName}",
    ]);
    k.wait(&["volumeattachment"], attached_to, NODE_NAME);
    assert!(
        node1.mount_table().contains(&pv),
        "{pv} not mounted on {NODE_NAME}"
    );
    assert!(!node2.mount_table().contains(&pv), "{pv} mounted on {NODE2_NAME}");
    k.show("a1: pod on realnode wrote to the claim; attached to realnode");

    k.must(&["delete", "pod", "-n", NS, "one", "--wait=true"]);
    k.apply(&pod_on("two", NODE2_NAME, "moving"));
    k.wait(&["pod", "-n", NS, "two"], "{.status.phase}", "Running");
    k.wait_logs("two", "have: one ");
    k.wait_logs("two", "wrote two");
    k.wait(&["volumeattachment"], "{.items[*].spec.nodeName}", NODE2_NAME);
    k.wait(&["volumeattachment"], attached_to, NODE2_NAME);
    assert!(
        node2.mount_table().contains(&pv),
        "{pv} not mounted on {NODE2_NAME}"
    );
    assert!(
        !node1.mount_table().contains(&pv),
        "{pv} still mounted on {NODE_NAME}"
    );
    k.show("a2: pod on realnode2 read it and wrote more; the attachment moved to realnode2");

    k.must(&["delete", "pod", "-n", NS, "two", "--wait=true"]);
    k.apply(&pod_on("three", NODE_NAME, "moving"));
    k.wait(&["pod", "-n", NS, "three"], "{.status.phase}", "Running");
    k.wait_logs("three", "have: one two ");
    k.wait(&["volumeattachment"], "{.items[*].spec.nodeName}", NODE_NAME);
    k.wait(&["volumeattachment"], attached_to, NODE_NAME);
    assert!(
        !node2.mount_table().contains(&pv),
        "{pv} still mounted on {NODE2_NAME}"
    );
    k.show("a3: back on realnode, both writes there; attached to realnode again");
    k.must(&["delete", "pod", "-n", NS, "three", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "moving", "--wait=false"]);
    k.wait_gone(&["pv", &pv]);

    // b. A pod on each node for one ReadWriteOnce claim: the second waits, with upstream's
    //    Multi-Attach event naming the pod that holds the volume, and starts once it is gone.
    k.apply(&claim("single", "loop", "ReadWriteOnce"));
    k.apply(&pod_on("holder", NODE_NAME, "single"));
    k.wait(&["pod", "-n", NS, "holder"], "{.status.phase}", "Running");
    let single = k.must(&[
        "get",
        "pvc",
        "-n",
        NS,
        "single",
        "-o",
        "jsonpath={.spec.volumeName}",
    ]);
    k.apply(&pod_on("blocked", NODE2_NAME, "single"));
    let want = format!("Multi-Attach error for volume \"{single}\" Volume is already used by pod(s) holder");
    poll(|| {
        let events = k
            .run(&[
                "get",
                "events",
                "-n",
                NS,
                "--field-selector",
                "involvedObject.name=blocked",
                "-o",
                "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
            ])
            .unwrap_or_default();
        match events
            .lines()
            .any(|l| l.starts_with("FailedAttachVolume: ") && l.contains(&want))
        {
            true => Ok(()),
            false => Err(format!("no FailedAttachVolume {want:?} for blocked: {events}")),
        }
    });
    println!(
        "{}",
        k.must(&["describe", "pod", "-n", NS, "blocked"])
            .lines()
            .skip_while(|l| !l.starts_with("Events:"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        k.must(&[
            "get",
            "pod",
            "-n",
            NS,
            "blocked",
            "-o",
            "jsonpath={.status.phase}"
        ]),
        "Pending"
    );
    k.wait(&["volumeattachment"], "{.items[*].spec.nodeName}", NODE_NAME);
    k.show("b1: second node's pod held back by the Multi-Attach rule");
    k.must(&["delete", "pod", "-n", NS, "holder", "--wait=true"]);
    k.wait(&["pod", "-n", NS, "blocked"], "{.status.phase}", "Running");
    k.wait(&["volumeattachment"], attached_to, NODE2_NAME);
    k.show("b2: first pod gone: attached to realnode2, the second pod runs");
    k.must(&["delete", "pod", "-n", NS, "blocked", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "single", "--wait=false"]);
    k.wait_gone(&["pv", &single]);
    k.wait_gone(&["volumeattachment", "--all-namespaces"]);
    for v in [&pv, &single] {
        assert!(!images.join(format!("{v}.img")).exists(), "image of {v} left");
    }
    k.show("done: volumes, attachments and images gone");

    helm.run(&["uninstall", "st", "-n", "stowage", "--wait"])
        .await
        .unwrap();
    drop(cluster);
    println!("two-node scenarios took {:?}", started.elapsed());
}

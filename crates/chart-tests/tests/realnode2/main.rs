//! stowage on two real nodes (`RealNode::start_cluster`): `realnode` in the host's namespaces
//! and `realnode2` in network and mount namespaces of its own, the chart installed once by helm
//! (one agent DaemonSet with one `agent.kubeletDir`, both on the host network). A claim moves
//! between the nodes with its data (the VolumeAttachment follows the pod), a second node's
//! pod asking for a claim attached elsewhere gets the Multi-Attach event, and a partitioned node
//! marked out of service keeps the other node's mount of its claim refused by ext4 multi-mount
//! protection until it is powered off. Each step prints `kubectl get pv,pvc,volumeattachment,pod`.
//!
//! Needs root and the archives `make test` builds, like the single-node scenarios.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use stowage_chart_tests::Helm;
use stowage_testkit::realnode::{NODE_NAME, NODE2_NAME, RealNode};
use support::{Kubectl, NS, archives, claim, control_plane, install_mode, poll};

// The single-node scenarios' helpers; not all of them are used here.
#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;

/// A pod pinned to `node` (through the scheduler, which WaitForFirstConsumer needs) that prints
/// what the claim holds, then appends its own name to it.
fn pod_on(name: &str, node: &str, claim: &str) -> String {
    support::writer_pod(name, claim, Some(node))
}

/// What an admin puts on a node that is shut down or cut off, so its pods and volumes move.
const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute";

/// Polls `ok` every 500 ms for up to `limit`; whether it passed.
fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if ok() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The pod's Events, `reason: message` a line.
fn pod_events(k: &Kubectl, pod: &str) -> String {
    let selector = format!("involvedObject.name={pod}");
    k.run(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        &selector,
        "-o",
        "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
    ])
    .unwrap_or_default()
}

/// The source of the mount at `point` in a mountinfo table.
fn mount_source(table: &str, point: &Path) -> Option<String> {
    table.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (left.split(' ').nth(4)? == point.to_str()?).then(|| right.split(' ').nth(1).map(String::from))?
    })
}

/// The stowage agent serving `node`: its process names the node in its environment (the chart's
/// downward-API `NODE_NAME`); every node's processes are visible from here.
fn agent_pid(node: &str) -> Option<String> {
    let want = format!("NODE_NAME={node}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid = e.file_name().to_str()?.to_string();
        pid.parse::<u32>().ok()?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        (comm.trim() == "stowage-agent" && env.split(|b| *b == 0).any(|v| v == want.as_bytes()))
            .then_some(pid)
    })
}

fn signal(sig: &str, pids: &[String]) {
    if pids.is_empty() {
        return;
    }
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .args(pids)
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} {pids:?} failed");
}

/// Appends `line` to `file` and makes it durable, as a process on the node would write.
fn append_synced(file: &Path, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .unwrap_or_else(|e| panic!("open {}: {e}", file.display()));
    f.write_all(line.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

/// What node 1's power-off does to the volume on `device` (one kernel plays both nodes): the
/// processes of its pod `uid` end (their mount namespaces hold the file system too), every mount
/// of the device goes, and the device is detached. The steps taken.
fn power_off(uid: &str, device: &str) -> Vec<String> {
    let mut done = vec![];
    let cgroup = format!("pod{uid}");
    let pids = || -> Vec<String> {
        std::fs::read_dir("/proc")
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().to_str().map(String::from))
                    .filter(|p| p.parse::<u32>().is_ok())
                    .filter(|p| {
                        std::fs::read_to_string(format!("/proc/{p}/cgroup"))
                            .is_ok_and(|c| c.contains(&cgroup))
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let pods = pids();
    signal("KILL", &pods);
    assert!(
        wait_until(Duration::from_secs(20), || pids().is_empty()),
        "processes of pod {uid} still there: {:?}",
        pids()
    );
    done.push(format!("kill {pods:?}"));
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut points: Vec<String> = table
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split(' ').nth(1)? == device).then(|| left.split(' ').nth(4).map(String::from))?
        })
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.matches('/').count()));
    for p in points {
        let status = Command::new("umount").arg(&p).status().expect("run umount");
        assert!(status.success(), "umount {p} failed");
        done.push(format!("umount {p}"));
    }
    let status = Command::new("losetup")
        .args(["-d", device])
        .status()
        .expect("run losetup");
    assert!(status.success(), "losetup -d {device} failed");
    done.push(format!("losetup -d {device}"));
    done
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kubelet_runs_pods_on_loop_volumes_across_two_nodes() {
    let started = Instant::now();
    let archives = archives();
    let (cp, images, _cleanup) = control_plane(2).await;
    let cluster = RealNode::start_cluster(&cp, &archives, 2).unwrap_or_else(|e| panic!("real nodes: {e:#}"));
    let (node1, node2) = (&cluster[0], &cluster[1]);
    // One store both nodes see (shared mode: a volume moves between them).
    for n in [node1, node2] {
        n.image_store(&images, false)
            .unwrap_or_else(|e| panic!("image store: {e:#}"));
    }
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
    install_mode(&helm, &k, &cp, &images, &node1.kubelet_dir, "shared", || {
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
    //    First without the shared store's marker, as where the shared file system is not
    //    mounted: no image is made; ImageStoreNotReady on the claim (from the controller) and on
    //    both Nodes (from their agents), the controller's gauge at 0. Then the marker is back and
    //    everything goes on by itself.
    let marker = images.join(stowage_loopdriver::image::MARKER);
    let saved = std::fs::read(&marker).unwrap();
    std::fs::remove_file(&marker).unwrap();
    k.apply(&claim("moving", "loop", "ReadWriteOnce"));
    k.apply(&pod_on("one", NODE_NAME, "moving"));
    poll(|| {
        let seen = k.event_objects("ImageStoreNotReady");
        let want = [
            "PersistentVolumeClaim/moving".to_string(),
            format!("Node/{NODE_NAME}"),
            format!("Node/{NODE2_NAME}"),
        ];
        match want.iter().all(|w| seen.contains(w)) {
            true => Ok(()),
            false => Err(format!(
                "ImageStoreNotReady events on {seen:?}; the claim:\n{}",
                k.run(&["describe", "pvc", "-n", NS, "moving"])
                    .unwrap_or_else(|e| e)
            )),
        }
    });
    let m = k.metrics(&support::controller_metrics_path(&k)).unwrap();
    assert_eq!(m.sum("stowage_binder_image_store_ready"), 0.0);
    let made: Vec<_> = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(made.is_empty(), "images made on an unmarked store: {made:?}");
    k.show("a0: no marker, no image; ImageStoreNotReady on the claim and both Nodes");
    std::fs::write(&marker, saved).unwrap();
    k.wait(&["pod", "-n", NS, "one"], "{.status.phase}", "Running");
    k.wait_logs("one", "wrote one");
    let pv = k.volume_of("moving");
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
    let single = k.volume_of("single");
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

    // c. A partitioned node (kubelet and agent gone, kernel still running) keeps its mount of a
    //    claim; marked out of service, its attachment is released and the claim attached to node 2,
    //    whose mount multi-mount protection refuses while node 1's is there. Once node 1 is
    //    "powered off" (its pod's processes, mounts and loop device gone), node 2 mounts it and
    //    reads what was written through node 1's mount, to the last line.
    k.apply(&claim("fenced", "loop", "ReadWriteOnce"));
    k.apply(&pod_on("before", NODE_NAME, "fenced"));
    k.wait(&["pod", "-n", NS, "before"], "{.status.phase}", "Running");
    k.wait_logs("before", "wrote before");
    let fenced = k.volume_of("fenced");
    let uid = k.must(&["get", "pod", "-n", NS, "before", "-o", "jsonpath={.metadata.uid}"]);
    k.wait(&["volumeattachment"], attached_to, NODE_NAME);
    // Node 1 is in the host's namespaces: its pod's volume is this path here.
    let volume_dir = node1
        .kubelet_dir
        .join(format!("pods/{uid}/volumes/kubernetes.io~csi/{fenced}/mount"));
    let device = mount_source(&node1.mount_table(), &volume_dir)
        .unwrap_or_else(|| panic!("{} not mounted on {NODE_NAME}", volume_dir.display()));
    assert!(device.starts_with("/dev/loop"), "{fenced} mounted from {device}");
    k.show("c1: pod on realnode wrote to the claim through its mount");

    node1.stop_kubelet();
    let agent = agent_pid(NODE_NAME).expect("no stowage-agent process of realnode");
    // Killed, not stopped: with the kubelet down nothing starts it again, and it unmounts nothing.
    signal("KILL", &[agent]);
    append_synced(&volume_dir.join("f"), "partitioned\n");
    k.show("c2: realnode partitioned: kubelet and agent gone, its pod and mount still there");
    k.wait(
        &["node", NODE_NAME],
        "{.status.conditions[?(@.type==\"Ready\")].status}",
        "Unknown",
    );
    k.must(&["taint", "node", NODE_NAME, OUT_OF_SERVICE]);
    // The taint evicts the pod and pod GC deletes it (an out-of-service node's terminating pods);
    // forced here only if that does not happen within the wait.
    let gone = wait_until(Duration::from_secs(120), || {
        k.run(&[
            "get",
            "pod",
            "-n",
            NS,
            "before",
            "--ignore-not-found",
            "-o",
            "name",
        ])
        .is_ok_and(|o| o.trim().is_empty())
    });
    if gone {
        println!("pod before deleted by the control plane (taint eviction, pod GC)");
    } else {
        println!("pod before not deleted by the control plane; force-deleting it");
        k.must(&["delete", "pod", "-n", NS, "before", "--force", "--grace-period=0"]);
    }
    k.show("c3: realnode NotReady and out of service, its pod deleted");
    k.apply(&pod_on("after", NODE2_NAME, "fenced"));
    // The released attachment of node 1 goes and node 2's is attached.
    k.wait(&["volumeattachment"], "{.items[*].spec.nodeName}", NODE2_NAME);
    k.wait(&["volumeattachment"], attached_to, NODE2_NAME);
    let mut refusal = String::new();
    poll(|| {
        // Checked on every round: a mount on node 2 now would be two kernels' mounts of one ext4.
        let phase = k
            .run(&["get", "pod", "-n", NS, "after", "-o", "jsonpath={.status.phase}"])
            .unwrap_or_default();
        let table = node2.mount_table();
        let mounted: Vec<&str> = table.lines().filter(|l| l.contains(&fenced)).collect();
        assert!(
            phase != "Running" && mounted.is_empty(),
            "{fenced} mounted on {NODE2_NAME} (pod after {phase}) while realnode still mounts it from {device}: {mounted:?}"
        );
        let events = pod_events(&k, "after");
        match events
            .lines()
            .find(|l| l.starts_with("FailedMount: ") && l.contains("multi-mount protection"))
        {
            Some(l) => {
                refusal = l.to_string();
                Ok(())
            }
            None => Err(format!(
                "no FailedMount naming multi-mount protection for after: {events}"
            )),
        }
    });
    println!("refused on {NODE2_NAME}: {refusal}");
    assert_eq!(
        mount_source(&node1.mount_table(), &volume_dir).as_deref(),
        Some(device.as_str()),
        "realnode's mount of {fenced} went: the fence, not a clean-up, must be what held node 2 back"
    );
    assert_eq!(
        k.must(&["get", "pod", "-n", NS, "after", "-o", "jsonpath={.status.phase}"]),
        "Pending"
    );
    k.show("c4: attached to realnode2; its mount refused by multi-mount protection");

    let undone = power_off(&uid, &device);
    println!("realnode powered off: {undone:?}");
    // The kubelet retries with back-off (up to about 2 min), and each refused try took ~21 s.
    assert!(
        wait_until(Duration::from_secs(300), || {
            k.run(&["get", "pod", "-n", NS, "after", "-o", "jsonpath={.status.phase}"])
                .is_ok_and(|p| p == "Running")
        }),
        "after not Running once realnode's mount went: {}",
        pod_events(&k, "after")
    );
    k.wait_logs("after", "have: before partitioned ");
    k.wait_logs("after", "wrote after");
    k.show("c5: realnode gone: realnode2 mounted the claim and read every line written on realnode");

    // Node 1 back in service: the taint goes, its kubelet comes back and cleans up.
    k.must(&["taint", "node", NODE_NAME, &format!("{OUT_OF_SERVICE}-")]);
    node1.start_kubelet_again().unwrap();
    k.wait(
        &["node", NODE_NAME],
        "{.status.conditions[?(@.type==\"Ready\")].status}",
        "True",
    );
    k.wait(
        &["daemonset", "-n", "stowage", "st-stowage-agent"],
        "{.status.numberReady}",
        "2",
    );
    // The DaemonSet's count may still be the one from before the partition: the agent's own
    // process tells that the kubelet started it again.
    assert!(
        wait_until(Duration::from_secs(180), || agent_pid(NODE_NAME).is_some()),
        "realnode's agent not started again: {}",
        node1.log_tail("kubelet")
    );
    k.show("c6: realnode back in service, its kubelet and agent running again");
    k.must(&["delete", "pod", "-n", NS, "after", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "fenced", "--wait=false"]);
    k.wait_gone(&["pv", &fenced]);
    k.wait_gone(&["volumeattachment", "--all-namespaces"]);
    for v in [&pv, &single, &fenced] {
        assert!(!images.join(format!("{v}.img")).exists(), "image of {v} left");
    }
    k.show("done: volumes, attachments and images gone");

    helm.run(&["uninstall", "st", "-n", "stowage", "--wait"])
        .await
        .unwrap();
    drop(cluster);
    println!("two-node scenarios took {:?}", started.elapsed());
}

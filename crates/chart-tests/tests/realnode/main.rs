//! stowage on a real node, installed the way a user installs it: the test control plane plus a
//! kubelet, containerd and runc (`stowage_testkit::realnode`), `helm install` of charts/stowage
//! with the image `make image` builds in the chart's default mode (the node's own image store),
//! then claims and pods of a WaitForFirstConsumer class: the node's agent makes the images, and
//! the kubelet stages and publishes through the agent's CSI node service; `helm test` passing on
//! a fresh install and failing with its reasons on a broken class. Each step prints
//! `kubectl get pv,pvc,volumeattachment,pod` so CI logs show what was observed.
//!
//! Needs root (loop devices, mounts, containers) and the archives `make test` builds
//! (target/image/{stowage-<version>,busybox,pause}.oci.tar).

use std::process::Command;
use std::time::Instant;

use stowage_chart_tests::chart_dir;
use stowage_testkit::realnode::{BUSYBOX_IMAGE, NODE_NAME};
use support::{NS, claim, install_mode, mounts_of, pod, poll, rollout, single_node};

// Shared with the other real-node scenarios, which use helpers this one does not.
#[allow(dead_code)]
mod support;

#[tokio::test(flavor = "multi_thread")]
async fn a_kubelet_runs_pods_on_loop_volumes_installed_by_helm() {
    let started = Instant::now();
    let (cp, images, _cleanup, node, k, helm) = single_node().await;
    println!("real node up after {:?}", started.elapsed());
    // The chart's default mode: the node's own store (local).
    install_mode(&helm, &k, &cp, &images, &node.kubelet_dir, "local", || {
        node.log_tail("kubelet")
    })
    .await;
    // The kubelet registered the driver: CSINode lists it.
    k.wait(
        &["csinode", NODE_NAME],
        "{.spec.drivers[*].name}",
        "loop.stowage.dev",
    );
    k.show("installed");

    // 0. `helm test`, as an operator runs it after installing: the checker pod reads the
    //    controller's /readyz through the metrics Service and sees a claim of the chart's
    //    WaitForFirstConsumer class bound and mounted by its consumer pod. `--logs` fetches a
    //    pod log per test hook name, which works because every hook has the checker's name.
    let out = helm
        .run(&["test", "st", "-n", "stowage", "--timeout", "5m", "--logs"])
        .await
        .unwrap_or_else(|e| {
            k.show("helm test failed");
            // How the test pods ended (exit code, reason), the namespace's Events and the
            // kubelet's lines on them: an eviction or a kill leaves no trace in the checker's
            // own log, which is already in `e`.
            let status = k
                .run(&[
                    "get",
                    "pod",
                    "-n",
                    "stowage",
                    "-l",
                    "app.kubernetes.io/component=test",
                    "-o",
                    "jsonpath={range .items[*]}{.metadata.name}: {.status.containerStatuses[*].state}{\"\\n\"}{end}",
                ])
                .unwrap_or_else(|e| e);
            let events = k
                .run(&["get", "events", "-n", "stowage", "--sort-by=.lastTimestamp"])
                .unwrap_or_else(|e| e);
            let kubelet = node.log_lines("kubelet", "st-stowage-test", 40);
            panic!(
                "{e}\ntest pods:\n{status}\nevents:\n{events}\nkubelet on the test pods:\n{kubelet}"
            )
        });
    println!("{out}");
    for want in [
        "Phase:          Succeeded",
        "ok: controller /readyz through Service st-stowage-controller-metrics answers ok",
        "ok: claim data-st-stowage-test-0 of class loop is Bound to ",
        "ok: pod st-stowage-test-0 wrote a file on ",
    ] {
        assert!(out.contains(want), "helm test output lacks {want:?}");
    }
    // It cleans up after itself: Helm deletes its RBAC and StatefulSet, the claim goes with the
    // StatefulSet and the volume with the claim (Delete class): detached, PV and image gone.
    let test_pv = out
        .lines()
        .find_map(|l| l.split_once(" is Bound to "))
        .map(|(_, pv)| pv.trim().to_string())
        .unwrap();
    k.wait_gone(&[
        "statefulset,serviceaccount,role,rolebinding",
        "-n",
        "stowage",
        "st-stowage-test",
    ]);
    k.wait_gone(&["pvc", "-n", "stowage", "data-st-stowage-test-0"]);
    k.wait_gone(&["pv", &test_pv]);
    k.wait_gone(&["volumeattachment", "--all-namespaces"]);
    assert!(
        !images.join(format!("{test_pv}.img")).exists(),
        "image of {test_pv} left"
    );
    k.show("0: helm test passed and left no claim, volume or attachment behind");

    // 1. WaitForFirstConsumer: claim + pod → the image made by the agent of the pod's node in
    //    that node's store, attached, staged and published by the kubelet through the agent; the
    //    pod writes a file. The store's marker is removed first, as on a node whose disk was just
    //    replaced: local mode needs no install step, so the agent marks its store anew, with an id
    //    of its own, and the volume records that id and is pinned to the node.
    let marker = images.join(stowage_loopdriver::image::MARKER);
    let old_id = support::marker_id(&images);
    std::fs::remove_file(&marker).unwrap();
    k.apply(&claim("data", "loop", "ReadWriteOnce"));
    k.apply(&pod("writer", "data"));
    k.wait(&["pod", "-n", NS, "writer"], "{.status.phase}", "Running");
    k.wait(&["pvc", "-n", NS, "data"], "{.status.phase}", "Bound");
    let pv = k.volume_of("data");
    let new_id = support::marker_id(&images);
    assert!(
        !new_id.is_empty() && new_id != old_id,
        "store marked anew: {old_id:?} → {new_id:?}"
    );
    let recorded = k.must(&[
        "get",
        "pv",
        &pv,
        "-o",
        "jsonpath={.metadata.annotations.loop\\.stowage\\.dev/store-id}|{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}",
    ]);
    assert_eq!(
        recorded.trim(),
        format!("{new_id}|{NODE_NAME}"),
        "{pv} records its store and node"
    );
    k.wait(&["volumeattachment"], "{.items[0].status.attached}", "true");
    k.wait_logs("writer", "wrote");
    k.show("1: pod Running on a provisioned, attached, staged and published volume");

    // 8. The kubelet reports the volume in use, which holds the detach back.
    let unique = format!("kubernetes.io/csi/loop.stowage.dev^{pv}");
    k.wait(&["node", NODE_NAME], "{.status.volumesInUse[0]}", &unique);
    // Device mounted twice: the kubelet's staging path and the pod's publish target.
    let staged = mounts_of(&node.kubelet_dir, &pv);
    assert!(!staged.is_empty(), "no mount of {pv} under the kubelet dir");

    // 2. Delete the pod, start another: it finds the file (no re-format).
    k.must(&["delete", "pod", "-n", NS, "writer", "--wait=true"]);
    k.apply(&pod("reader", "data"));
    k.wait(&["pod", "-n", NS, "reader"], "{.status.phase}", "Running");
    k.wait_logs("reader", "found data-1");
    k.show("2: a new pod reads the file the first one wrote");

    // 4. Restart the agent pod, then the kubelet, while the pod runs: it keeps running, no
    //    second mount of the device.
    let before = mounts_of(&node.kubelet_dir, &pv).len();
    k.must(&[
        "delete",
        "pod",
        "-n",
        "stowage",
        "-l",
        "app.kubernetes.io/component=agent",
        "--wait=true",
    ]);
    rollout(&k, "daemonset/st-stowage-agent", || node.log_tail("kubelet"));
    node.restart_kubelet().unwrap();
    k.wait(
        &["node", NODE_NAME],
        "{.status.conditions[?(@.type==\"Ready\")].status}",
        "True",
    );
    // Until the restarted kubelet (its counters start at zero) has published the volume again
    // through the agent and finished as many pod syncs as the node runs pods: a sync is where it
    // would restart a container, and the publish where a second mount would come from.
    let running = k
        .must(&[
            "get",
            "pods",
            "-A",
            "--field-selector",
            &format!("spec.nodeName={NODE_NAME},status.phase=Running"),
            "-o",
            "name",
        ])
        .lines()
        .count() as f64;
    poll(|| {
        let m = k.metrics(&format!("/api/v1/nodes/{NODE_NAME}/proxy/metrics"))?;
        let published = m.sum_where(
            "csi_operations_seconds_count",
            &[
                ("driver_name", "loop.stowage.dev"),
                ("method_name", "/csi.v1.Node/NodePublishVolume"),
                ("grpc_status_code", "OK"),
            ],
        );
        let synced: f64 = ["create", "update", "sync"]
            .iter()
            .map(|t| {
                m.sum_where(
                    "kubelet_pod_worker_duration_seconds_count",
                    &[("operation_type", *t)],
                )
            })
            .sum();
        match published >= 1.0 && synced >= running {
            true => Ok(()),
            false => Err(format!(
                "restarted kubelet: {published} publishes, {synced} syncs of {running} pods"
            )),
        }
    });
    k.wait(
        &["pod", "-n", NS, "reader"],
        "{.status.containerStatuses[0].restartCount}",
        "0",
    );
    assert_eq!(mounts_of(&node.kubelet_dir, &pv).len(), before, "no second mount");
    k.show("4: agent and kubelet restarted under a running pod");

    // 8. The kubelet's volumesInUse holds the detach back: with the kubelet stopped, a pod
    //    deleted by force leaves its mounts, and the attachment stays; once the kubelet is back
    //    and has unmounted, it goes.
    k.apply(&claim("held", "loop", "ReadWriteOnce"));
    k.apply(&pod("holder", "held"));
    k.wait(&["pod", "-n", NS, "holder"], "{.status.phase}", "Running");
    let held = k.volume_of("held");
    let held_va = format!("{{.items[?(@.spec.source.persistentVolumeName==\"{held}\")].status.attached}}");
    k.wait(&["volumeattachment"], &held_va, "true");
    node.stop_kubelet();
    k.must(&["delete", "pod", "-n", NS, "holder", "--force", "--grace-period=0"]);
    // The controller's metrics through its pod's proxy, not the Service: with the kubelet
    // stopped, the node turns NotReady after its grace period and its pods (the controller's
    // too) leave the Service's endpoints, while the container keeps running and answering.
    let controller_metrics = support::controller_metrics_path(&k);
    let controller = || k.metrics(&controller_metrics);
    // Until the attach/detach controller wants the detach and holds it back for the node's
    // volumesInUse, then has passed over it once more: it had its chance to detach.
    let mut passes = 0.0;
    poll(|| {
        let m = controller()?;
        passes = m.sum("stowage_attachdetach_reconcile_total");
        match m.sum("stowage_attachdetach_detaches_waiting_for_unmount") >= 1.0 {
            true => Ok(()),
            false => Err("no detach waits for the unmount yet".into()),
        }
    });
    poll(
        || match controller()?.sum("stowage_attachdetach_reconcile_total") > passes {
            true => Ok(()),
            false => Err(format!("no attach/detach pass after {passes}")),
        },
    );
    assert_eq!(
        k.must(&["get", "volumeattachment", "-o", &format!("jsonpath={held_va}")])
            .trim(),
        "true",
        "the attachment of a volume the node still reports in use must stay"
    );
    assert!(
        !mounts_of(&node.kubelet_dir, &held).is_empty(),
        "still mounted while the kubelet is down"
    );
    k.show("8: kubelet down, pod force-deleted: volume still in use, attachment kept");
    node.start_kubelet_again().unwrap();
    k.wait(&["volumeattachment"], &held_va, "");
    assert!(
        mounts_of(&node.kubelet_dir, &held).is_empty(),
        "the kubelet unmounted it"
    );
    k.must(&["delete", "pvc", "-n", NS, "held", "--wait=false"]);
    k.show("8: kubelet back: unmounted, then detached");

    // 5. A Block claim used as a raw device, and an fsGroup pod that sees group ownership.
    k.apply(&format!(
        r#"apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: raw, namespace: {NS}}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: loop
  resources: {{requests: {{storage: 64Mi}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: raw-user, namespace: {NS}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: [sh, -c, 'echo "size $(blockdev --getsize64 /dev/xvda)"; sleep 3600']
    volumeDevices: [{{name: v, devicePath: /dev/xvda}}]
  volumes: [{{name: v, persistentVolumeClaim: {{claimName: raw}}}}]
"#
    ));
    k.apply(&claim("grouped", "loop", "ReadWriteOnce"));
    k.apply(&format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: grouped-user, namespace: {NS}}}
spec:
  terminationGracePeriodSeconds: 1
  securityContext: {{runAsUser: 1000, runAsGroup: 1000, fsGroup: 4321}}
  containers:
  - name: c
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: [sh, -c, 'echo "group $(stat -c %g /data)"; touch /data/mine && echo writable; sleep 3600']
    volumeMounts: [{{name: v, mountPath: /data}}]
  volumes: [{{name: v, persistentVolumeClaim: {{claimName: grouped}}}}]
"#
    ));
    for (p, want) in [("raw-user", "size 67108864"), ("grouped-user", "group 4321")] {
        k.wait(&["pod", "-n", NS, p], "{.status.phase}", "Running");
        k.wait_logs(p, want);
    }
    assert!(
        k.logs("grouped-user").contains("writable"),
        "{}",
        k.logs("grouped-user")
    );
    k.show("5: a raw block device, and fsGroup ownership");
    for p in ["raw-user", "grouped-user"] {
        k.must(&["delete", "pod", "-n", NS, p, "--wait=true"]);
    }
    k.must(&["delete", "pvc", "-n", NS, "raw", "grouped", "--wait=false"]);

    // 7. A claim for several writers of the loop class is refused with an Event that says why.
    k.apply(&claim("shared", "loop", "ReadWriteMany"));
    k.apply(&pod("shared-user", "shared"));
    poll(|| {
        let events = k.events("involvedObject.name=shared", "reason");
        match events.contains("ProvisioningFailed") {
            true => Ok(()),
            false => Err(format!("no ProvisioningFailed for shared: {events}")),
        }
    });
    println!("{}", k.must(&["describe", "pvc", "-n", NS, "shared"]));
    k.must(&["delete", "pod", "-n", NS, "shared-user", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "shared", "--wait=true"]);

    // 3. Grow the claim while the pod runs. The controller grows the image and the PV; the
    //    kubelet's NodeExpandVolume grows ext4 online where the kernel lets it (it needs
    //    CAP_SYS_RESOURCE, which root lacks on these machines: the volume's next stage then grows
    //    it offline), so the check is made from a pod started after the expansion.
    k.must(&[
        "patch",
        "pvc",
        "-n",
        NS,
        "data",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ]);
    k.wait(&["pv", &pv], "{.spec.capacity.storage}", "128Mi");
    k.must(&["delete", "pod", "-n", NS, "reader", "--wait=true"]);
    k.apply(&pod("grown", "data"));
    k.wait(&["pod", "-n", NS, "grown"], "{.status.phase}", "Running");
    k.wait_logs("grown", "found data-1");
    k.wait(&["pvc", "-n", NS, "data"], "{.status.capacity.storage}", "128Mi");
    k.wait(&["pvc", "-n", NS, "data"], "{.status.conditions}", "");
    let df = k.logs("grown");
    let kb: u64 = df
        .lines()
        .find(|l| l.contains("/data"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no df line: {df}"));
    assert!(kb > 110 * 1024, "the pod sees the grown file system: {df}");
    k.show("3: claim grown to 128Mi; the pod's file system has the new size, conditions cleared");

    // 6. Delete pod and claim (Delete policy): unpublish, unstage, detach, VolumeAttachment
    //    gone, image removed, PV gone.
    // With Retain the image stays (the volume is Released, its data kept for an admin).
    k.apply(support::RETAIN_CLASS);
    k.apply(&claim("kept", "loop-retain", "ReadWriteOnce"));
    k.apply(&pod("keeper", "kept"));
    k.wait(&["pod", "-n", NS, "keeper"], "{.status.phase}", "Running");
    k.wait_logs("keeper", "wrote");
    let kept = k.volume_of("kept");
    k.must(&["delete", "pod", "-n", NS, "keeper", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "kept", "--wait=true"]);
    k.wait(&["pv", &kept], "{.status.phase}", "Released");
    k.must(&["delete", "pod", "-n", NS, "grown", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "data", "--wait=false"]);
    k.wait_gone(&["pv", &pv]);
    k.wait_gone(&["volumeattachment", "--all-namespaces"]);
    poll(|| match images.join(format!("{pv}.img")).exists() {
        true => Err(format!("image of {pv} still there")),
        false => Ok(()),
    });
    assert!(
        mounts_of(&node.kubelet_dir, &pv).is_empty(),
        "mounts of {pv} left"
    );
    // The device an earlier agent pod attached is released by its successor.
    poll(|| {
        let loops = String::from_utf8(Command::new("losetup").arg("-a").output().unwrap().stdout).unwrap();
        match loops.contains(&pv) {
            true => Err(format!("loop device of {pv} left:\n{loops}")),
            false => Ok(()),
        }
    });
    assert!(
        images.join(format!("{kept}.img")).exists(),
        "a Retain volume keeps its image"
    );
    k.show("6: Delete: PV, attachment, image and loop device gone; Retain: Released, image kept");

    // 9. A failing `helm test` says why: a class that does not exist leaves the claim Pending,
    //    and helm's own output carries the checker's log with the claim's conditions and Events
    //    (hook-output-log-policy). The claim is deleted all the same.
    helm.run(&[
        "upgrade",
        "st",
        chart_dir().to_str().unwrap(),
        "-n",
        "stowage",
        "--reuse-values",
        "--set",
        "tests.storageClassName=missing,tests.timeoutSeconds=10",
    ])
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let e = helm
        .run(&["test", "st", "-n", "stowage", "--timeout", "2m"])
        .await
        .expect_err("helm test with a missing class must fail");
    println!("{e}");
    for want in [
        "ok: controller /readyz through Service st-stowage-controller-metrics answers ok",
        "FAIL: claim data-st-stowage-test-0 of class missing not Bound after 10s",
        "PersistentVolumeClaim data-st-stowage-test-0:\n  phase: Pending\n  type: stowage.dev/Pending\n  reason: ProvisioningFailed",
        "Pod st-stowage-test-0:\n  phase: Pending",
        "  Events:\n    reason: ",
        "pod st-stowage-test failed",
    ] {
        assert!(e.contains(want), "failed helm test output lacks {want:?}");
    }
    k.wait_gone(&[
        "statefulset,pvc",
        "-n",
        "stowage",
        "st-stowage-test",
        "data-st-stowage-test-0",
    ]);
    k.show("9: a failing helm test names the Pending claim and cleans up");

    helm.run(&["uninstall", "st", "-n", "stowage", "--wait"])
        .await
        .unwrap();
    drop(node);
    println!("real-node scenarios took {:?}", started.elapsed());
}

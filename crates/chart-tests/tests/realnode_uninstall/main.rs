//! Moving a real node back to kube-controller-manager and uninstalling stowage, step by step as
//! docs/distributions.md ("Moving back to kube-controller-manager, and uninstalling") writes it,
//! with claims bound and pods running: a loop.stowage.dev claim whose pod wrote a file and a
//! static hostPath pair with its pod. After each step the pods keep their volumes and data, new
//! claims bind (by KCM), a loop volume still detaches and attaches while the agent stays, the
//! finalizers left are the ones the guide's table lists, and whatever the guide says may be
//! deleted goes within the bound. Each step prints `kubectl get pv,pvc,volumeattachment,pod`.
//!
//! Needs root and the archives `make test` builds, like the single-node scenarios.

use std::time::Instant;

use stowage_chart_tests::chart_dir;
use stowage_testkit::realnode::NODE_NAME;
use support::{Kubectl, NS, claim, install_mode, pod, poll, single_node};

// The single-node scenarios' helpers; not all of them are used here.
#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;

/// A hostPath PV (Retain, no class) and a claim that matches only it: a static pair of a kind
/// stowage does not drive, bound by whichever binder runs.
fn static_pair(name: &str, dir: &std::path::Path) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata: {{name: {name}, labels: {{pair: {name}}}}}
spec:
  capacity: {{storage: 64Mi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {{path: {path}, type: DirectoryOrCreate}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: {NS}}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  selector: {{matchLabels: {{pair: {name}}}}}
  resources: {{requests: {{storage: 64Mi}}}}
"#,
        path = dir.join(name).display(),
    )
}

/// The finalizers of one object, sorted, comma-separated.
fn finalizers(k: &Kubectl, what: &[&str]) -> String {
    let mut args = vec!["get"];
    args.extend_from_slice(what);
    args.extend_from_slice(&["-o", "jsonpath={.metadata.finalizers[*]}"]);
    let mut f: Vec<String> = k.must(&args).split_whitespace().map(String::from).collect();
    f.sort();
    f.join(",")
}

/// The field managers that wrote an object.
fn managers(k: &Kubectl, what: &[&str]) -> String {
    let mut args = vec!["get"];
    args.extend_from_slice(what);
    args.extend_from_slice(&["-o", "jsonpath={.metadata.managedFields[*].manager}"]);
    k.must(&args)
}

/// The pod still runs its first container and reads the file it wrote.
fn keeps_its_data(k: &Kubectl, pod: &str) {
    k.wait(&["pod", "-n", NS, pod], "{.status.phase}", "Running");
    k.wait(
        &["pod", "-n", NS, pod],
        "{.status.containerStatuses[0].restartCount}",
        "0",
    );
    let data = k.must(&["exec", "-n", NS, pod, "--", "cat", "/data/f"]);
    assert_eq!(data.trim(), "data-1", "{pod} reads its volume");
}

/// Waits for the claim to be Bound and says which managers wrote its volume.
fn binds(k: &Kubectl, name: &str) -> String {
    k.wait(&["pvc", "-n", NS, name], "{.status.phase}", "Bound");
    k.wait(&["pv", name], "{.status.phase}", "Bound");
    managers(k, &["pv", name])
}

#[tokio::test(flavor = "multi_thread")]
async fn moving_back_to_kcm_and_uninstalling_leaves_pods_their_volumes_and_nothing_stuck() {
    let started = Instant::now();
    let (cp, images, _cleanup, node, k, helm) = single_node().await;
    // Local mode, the chart's default: the node's own store.
    install_mode(&helm, &k, &cp, &images, &node.kubelet_dir, "local", || {
        node.log_tail("kubelet")
    })
    .await;
    let host_dirs = cp.dir().join("hostpath");
    std::fs::create_dir_all(&host_dirs).unwrap();

    // Under stowage (KCM's storage controllers off): a loop claim with a pod that wrote a file,
    // and a static hostPath pair with its pod.
    k.apply(&claim("data", "loop", "ReadWriteOnce"));
    k.apply(&pod("writer", "data"));
    k.apply(&static_pair("host-a", &host_dirs));
    k.apply(&pod("host-user", "host-a"));
    for p in ["writer", "host-user"] {
        k.wait(&["pod", "-n", NS, p], "{.status.phase}", "Running");
        k.wait_logs(p, "wrote");
    }
    let pv = k.volume_of("data");
    k.wait(&["volumeattachment"], "{.items[0].status.attached}", "true");
    k.show("0: stowage installed, KCM's storage controllers off; both pods wrote their file");
    println!(
        "loop PV {pv} finalizers under stowage: {}",
        finalizers(&k, &["pv", &pv])
    );

    // Step 1: the controller goes, the agent and CSIDriver stay.
    let step = Instant::now();
    helm.run(&[
        "upgrade",
        "st",
        chart_dir().to_str().unwrap(),
        "-n",
        "stowage",
        "--reuse-values",
        "--set",
        "controller.enabled=false",
        "--wait",
    ])
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    k.wait_gone(&["deployment", "-n", "stowage", "st-stowage-controller"]);
    k.wait_gone(&[
        "pods",
        "-n",
        "stowage",
        "-l",
        "app.kubernetes.io/component=controller",
    ]);
    k.must(&["get", "daemonset", "-n", "stowage", "st-stowage-agent"]);
    k.must(&["get", "csidriver", "loop.stowage.dev"]);
    k.show(&format!(
        "1: controller.enabled=false: controller gone, agent kept ({:?})",
        step.elapsed()
    ));

    // Step 2: KCM with its default --controllers again.
    let step = Instant::now();
    node.restart_kcm(&cp, "*").unwrap();
    for p in ["writer", "host-user"] {
        keeps_its_data(&k, p);
    }
    // A new claim binds, by KCM's binder (no stowage controller runs).
    k.apply(&static_pair("host-b", &host_dirs));
    let by = binds(&k, "host-b");
    assert!(by.contains("kube-controller-manager"), "host-b bound by {by}");
    // A loop volume still detaches and attaches while the agent stays: the pod goes (the kubelet
    // unmounts through the agent, KCM deletes the attachment, the agent detaches and releases
    // it), and a new pod of the claim gets it back, attached through KCM's VolumeAttachment.
    k.must(&["delete", "pod", "-n", NS, "writer", "--wait=true"]);
    k.wait_gone(&["volumeattachment", "--all-namespaces"]);
    k.apply(&pod("reader", "data"));
    k.wait(&["pod", "-n", NS, "reader"], "{.status.phase}", "Running");
    k.wait_logs("reader", "found data-1");
    let va = k.must(&[
        "get",
        "volumeattachment",
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ]);
    let by = managers(&k, &["volumeattachment", &va]);
    assert!(by.contains("kube-controller-manager"), "{va} made by {by}");
    k.show(&format!(
        "2: KCM's controllers on: pods keep their data, host-b bound by KCM, the loop claim moved to a new pod ({:?})",
        step.elapsed()
    ));

    // Step 3: before the agent goes, the pods of loop volumes go, and their attachments.
    let step = Instant::now();
    k.must(&["delete", "pod", "-n", NS, "reader", "--wait=true"]);
    k.wait_gone(&["volumeattachment", "--all-namespaces"]);
    k.show(&format!(
        "3: no pod uses a loop volume, no attachment left ({:?})",
        step.elapsed()
    ));

    // Step 4: helm uninstall.
    let step = Instant::now();
    helm.run(&["uninstall", "st", "-n", "stowage", "--wait"])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    k.wait_gone(&["daemonset,deployment", "-n", "stowage"]);
    k.wait_gone(&["pods", "-n", "stowage", "-l", "app.kubernetes.io/instance=st"]);
    k.wait_gone(&["csidriver", "loop.stowage.dev"]);
    k.show(&format!("4: helm uninstall ({:?})", step.elapsed()));

    // After it: the hostPath pod keeps its data, a new claim binds.
    keeps_its_data(&k, "host-user");
    k.apply(&static_pair("host-c", &host_dirs));
    let by = binds(&k, "host-c");
    assert!(by.contains("kube-controller-manager"), "host-c bound by {by}");

    // What is left is what the guide's table lists: the protection finalizers on every claim
    // and PV (KCM's now), and on the loop volume stowage's deleter finalizer and the attacher's
    // finalizer stowage's attach/detach controller put there while it was attached.
    let fins: Vec<(String, String)> = [
        ("pvc", "data"),
        ("pvc", "host-a"),
        ("pvc", "host-c"),
        ("pv", pv.as_str()),
        ("pv", "host-a"),
        ("pv", "host-c"),
    ]
    .iter()
    .map(|(kind, name)| {
        let what: Vec<&str> = match *kind {
            "pvc" => vec!["pvc", "-n", NS, name],
            _ => vec!["pv", name],
        };
        (format!("{kind}/{name}"), finalizers(&k, &what))
    })
    .collect();
    println!("finalizers after uninstall: {fins:?}");
    for (obj, f) in &fins {
        let want = match obj.as_str() {
            o if o == format!("pv/{pv}") => {
                "external-attacher/loop-stowage-dev,kubernetes.io/pv-protection,loop.stowage.dev/deleter"
            }
            o if o.starts_with("pvc/") => "kubernetes.io/pvc-protection",
            _ => "kubernetes.io/pv-protection",
        };
        assert_eq!(f, want, "finalizers of {obj}");
    }
    let vas = k.must(&["get", "volumeattachment", "-o", "name"]);
    assert!(vas.trim().is_empty(), "attachments left: {vas}");
    k.show("4: after uninstall: host-c bound by KCM, finalizers as the guide lists");

    // What the guide says may be deleted goes. The hostPath pair: KCM's protection controllers
    // let the claim and then the volume go.
    let step = Instant::now();
    k.must(&["delete", "pod", "-n", NS, "host-user", "--wait=true"]);
    k.must(&["delete", "pvc", "-n", NS, "host-a", "--wait=false"]);
    k.wait_gone(&["pvc", "-n", NS, "host-a"]);
    k.wait(&["pv", "host-a"], "{.status.phase}", "Released");
    k.must(&["delete", "pv", "host-a", "--wait=false"]);
    k.wait_gone(&["pv", "host-a"]);
    // The loop claim goes; its volume is Released and stays (KCM leaves its deletion to the
    // provisioner loop.stowage.dev, which left with the chart).
    k.must(&["delete", "pvc", "-n", NS, "data", "--wait=false"]);
    k.wait_gone(&["pvc", "-n", NS, "data"]);
    k.wait(&["pv", &pv], "{.status.phase}", "Released");
    // Deleted, it waits on stowage's two finalizers only (KCM's pv-protection lets a Released
    // volume go) until they are removed by hand as the guide says; its image stays for the
    // operator to delete.
    k.must(&["delete", "pv", &pv, "--wait=false"]);
    poll(|| match finalizers(&k, &["pv", &pv]).as_str() {
        "external-attacher/loop-stowage-dev,loop.stowage.dev/deleter" => Ok(()),
        f => Err(format!("{pv} finalizers {f}")),
    });
    k.show("5: the loop volume deleted: Terminating on stowage's finalizers");
    k.must(&[
        "patch",
        "pv",
        &pv,
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/metadata/finalizers"}]"#,
    ]);
    k.wait_gone(&["pv", &pv]);
    let image = images.join(format!("{pv}.img"));
    assert!(
        image.exists(),
        "the uninstall keeps the image {}",
        image.display()
    );
    std::fs::remove_file(&image).unwrap();
    // Nothing is left Terminating.
    poll(|| {
        let stuck = k
            .run(&[
                "get",
                "pv,pvc,volumeattachment,pod",
                "-A",
                "-o",
                "jsonpath={range .items[?(@.metadata.deletionTimestamp)]}{.kind}/{.metadata.name} {end}",
            ])
            .unwrap_or_else(|e| e);
        match stuck.trim().is_empty() {
            true => Ok(()),
            false => Err(format!("still Terminating: {stuck}")),
        }
    });
    k.show(&format!(
        "5: everything deleted went, nothing Terminating ({:?})",
        step.elapsed()
    ));
    k.wait(&["node", NODE_NAME], "{.status.volumesAttached}", "");
    drop(node);
    println!("moving back and uninstalling took {:?}", started.elapsed());
}

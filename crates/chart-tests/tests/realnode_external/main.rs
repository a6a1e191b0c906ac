//! A third-party CSI driver on a real node, side by side: the same workload once with
//! kube-controller-manager's own storage controllers (no stowage) and once with stowage-controller
//! (KCM's storage controllers off), and the end states compared.
//!
//! The driver is the loop driver served under a second name, `ext.loop.stowage.dev`, which stowage
//! neither provisions nor attaches: the upstream external-provisioner and external-attacher
//! (`make sidecars`, linked at `e2e/sidecars/*/bin`) drive its Controller service on a unix socket,
//! and `stowage-agent --csi-only --csi-driver-name ext.loop.stowage.dev` is its node plugin,
//! registered with the kubelet. All run as processes beside the node (see docs/csi.md). The
//! controllers only hand off (selected-node, storage-provisioner), bind, create VolumeAttachments
//! and protect: what KCM does for any CSI driver.
//!
//! Scenarios, per reclaim policy (Delete, Retain): a WaitForFirstConsumer claim, a pod that
//! writes, a second pod that reads, the claim deleted. At each checkpoint the claim, its volume
//! and the VolumeAttachments are reduced to what matters (phase, annotations, finalizers,
//! attachment state; generated names masked) and the two runs must agree.
//!
//! Needs root, `make controlplane sidecars node-images`.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use stowage_chart_tests::repo_root;
use stowage_testkit::process::free_port;
use stowage_testkit::realnode::{KCM_CONTROLLERS, NODE_NAME, RealNode};
#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;
use support::{Kubectl, NS, claim, control_plane, poll};

use stowage_testkit::realnode::external::{self, DRIVER};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Controllers {
    Kcm,
    Stowage,
}

/// Checkpoint name → the reduced objects seen there, one line each.
type Snapshots = Vec<(String, Vec<String>)>;

#[tokio::test(flavor = "multi_thread")]
async fn a_third_party_csi_driver_ends_in_the_same_states_under_kcm_and_stowage() {
    let kcm = run(Controllers::Kcm).await;
    let stowage = run(Controllers::Stowage).await;
    let mut table = String::from("| checkpoint | kube-controller-manager | stowage |\n| --- | --- | --- |\n");
    let mut differ = vec![];
    for ((step, a), (_, b)) in kcm.iter().zip(&stowage) {
        let cell = if a == b {
            "same".to_string()
        } else {
            b.join("<br>")
        };
        table.push_str(&format!("| {step} | {} | {cell} |\n", a.join("<br>")));
        let (a, b) = (without_documented(a), without_documented(b));
        if a != b {
            differ.push(format!("{step}:\n  kcm:     {a:?}\n  stowage: {b:?}"));
        }
    }
    println!("{table}");
    let _ = std::fs::write(repo_root().join("target/realnode-external.md"), &table);
    assert_eq!(kcm.len(), stowage.len());
    assert!(differ.is_empty(), "end states differ:\n{}", differ.join("\n"));
}

/// The state without what is known to differ, each in docs/attachdetach.md ("Side by side with
/// kube-controller-manager"):
/// - deliberate: stowage keeps the reason a claim is Pending as condition `stowage.dev/Pending`;
/// - timing: stowage's binder wakes a delayed claim when a pod using it appears, so it always
///   says `WaitForPodScheduled` while the pod waits for the scheduler; KCM's binder syncs claims
///   on claim events and its 15 s resync only, so it says it when a resync falls in that window.
fn without_documented(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter(|l| !l.ends_with(" WaitForPodScheduled"))
        .map(|l| {
            let Some(start) = l.find("conditions=[") else {
                return l.clone();
            };
            let from = start + "conditions=[".len();
            let end = from + l[from..].find(']').unwrap_or(0);
            let kept: Vec<&str> = l[from..end]
                .split(", ")
                .filter(|c| !c.is_empty() && !c.starts_with("stowage.dev/Pending="))
                .collect();
            format!("{}{}{}", &l[..from], kept.join(", "), &l[end..])
        })
        .collect()
}

/// Where the workspace built its binaries: `target/<profile>/`, beside this test's `deps/`.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

async fn run(set: Controllers) -> Snapshots {
    println!("==== {set:?} ====");
    let dir = repo_root().join("target/image");
    let archives = vec![dir.join("busybox.oci.tar"), dir.join("pause.oci.tar")];
    let (cp, images, _cleanup) = control_plane(1).await;
    // The install step: the driver's CreateVolume refuses a store without its marker.
    stowage_loopdriver::ImageStore::new(&images).init().unwrap();
    // KCM with all its controllers, or without the five stowage replaces.
    let kcm = match set {
        Controllers::Kcm => "*",
        Controllers::Stowage => KCM_CONTROLLERS,
    };
    let node = RealNode::start_with_kcm(&cp, &archives, kcm).unwrap_or_else(|e| panic!("real node: {e:#}"));
    let kubeconfig = cp.kubeconfig();
    let kc = kubeconfig.display().to_string();
    let k = Kubectl {
        kubeconfig: kubeconfig.clone(),
    };
    // The driver's plugins and the two sidecars, beside the node.
    let bins = external::Binaries::find(&bin_dir()).unwrap_or_else(|e| panic!("{e:#}"));
    external::start(std::slice::from_ref(&node), &kubeconfig, &images, &bins)
        .unwrap_or_else(|e| panic!("{DRIVER}: {e:#}"));
    if set == Controllers::Stowage {
        let mut c = Command::new(bin_dir().join("stowage-controller"));
        c.arg(format!("--kubeconfig={kc}"))
            .args(["--leader-elect=false"])
            .arg(format!("--image-dir={}", images.display()))
            .arg(format!("--metrics-bind-address=127.0.0.1:{}", free_port()));
        node.spawn_beside("stowage-controller", c).unwrap();
    }

    k.apply(&format!(
        r#"apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {{name: {DRIVER}}}
spec: {{attachRequired: true, podInfoOnMount: false, fsGroupPolicy: File, volumeLifecycleModes: [Persistent]}}
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: ext-delete}}
provisioner: {DRIVER}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: ext-retain}}
provisioner: {DRIVER}
reclaimPolicy: Retain
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: Namespace
metadata: {{name: {NS}}}
"#
    ));
    // The kubelet lists the driver once its node plugin registered.
    k.wait(&["csinode", NODE_NAME], "{.spec.drivers[*].name}", DRIVER);
    poll(|| match k.run(&["get", "serviceaccount", "default", "-n", NS]) {
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    });

    let mut snaps = Snapshots::new();
    let logs = || {
        [
            "csi-provisioner",
            "csi-attacher",
            "ext-node-plugin",
            "stowage-controller",
            "kube-controller-manager",
        ]
        .iter()
        .map(|n| format!("--- {n}\n{}", node.log_tail(n)))
        .collect::<Vec<_>>()
        .join("\n")
    };
    for policy in ["Delete", "Retain"] {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            scenario(&k, &images, policy, &mut snaps)
        }));
        if let Err(e) = result {
            k.show("scenario failed");
            println!("{}", logs());
            std::panic::resume_unwind(e);
        }
    }
    drop(node);
    snaps
}

fn scenario(k: &Kubectl, images: &Path, policy: &str, snaps: &mut Snapshots) {
    let lower = policy.to_lowercase();
    let c = format!("c-{lower}");
    let class = format!("ext-{lower}");
    let mut snap = |step: &str, k: &Kubectl| {
        snaps.push((format!("{policy}: {step}"), state(k, &c)));
    };
    k.apply(&claim(&c, &class, "ReadWriteOnce"));
    // Both controller sets say why the claim waits, as an Event, before anything else happens.
    poll(|| {
        let ev = k.run(&[
            "get",
            "events",
            "-n",
            NS,
            "--field-selector",
            &format!("involvedObject.name={c},reason=WaitForFirstConsumer"),
            "-o",
            "name",
        ])?;
        if ev.trim().is_empty() {
            Err(format!("{c}: no WaitForFirstConsumer event yet"))
        } else {
            Ok(())
        }
    });
    snap("claim waits for its first consumer", k);

    let writer = format!("writer-{lower}");
    k.apply(&support::pod(&writer, &c));
    k.wait_logs(&writer, "wrote");
    k.wait(&["pvc", &c, "-n", NS], "{.status.phase}", "Bound");
    let pv = k.must(&["get", "pvc", &c, "-n", NS, "-o", "jsonpath={.spec.volumeName}"]);
    let pv = pv.trim().to_string();
    assert!(
        images.join(format!("{pv}.img")).exists(),
        "the sidecar's CreateVolume made no image"
    );
    wait_attached(k, &pv, true);
    snap("first pod wrote", k);

    k.must(&["delete", "pod", &writer, "-n", NS, "--wait=true"]);
    wait_attached(k, &pv, false);
    snap("first pod deleted, volume detached", k);

    let reader = format!("reader-{lower}");
    k.apply(&support::pod(&reader, &c));
    k.wait_logs(&reader, "found data-1");
    wait_attached(k, &pv, true);
    snap("second pod read the data", k);
    k.must(&["delete", "pod", &reader, "-n", NS, "--wait=true"]);
    wait_attached(k, &pv, false);

    k.must(&["delete", "pvc", &c, "-n", NS, "--wait=false"]);
    k.wait_gone(&["pvc", &c, "-n", NS]);
    let img = images.join(format!("{pv}.img"));
    match policy {
        "Delete" => {
            k.wait_gone(&["pv", &pv]);
            poll(|| match img.exists() {
                true => Err(format!("{} still there", img.display())),
                false => Ok(()),
            });
            snap("claim deleted: volume and image gone", k);
        }
        _ => {
            k.wait(&["pv", &pv], "{.status.phase}", "Released");
            assert!(img.exists(), "a Retain volume's image was deleted");
            snap("claim deleted: volume Released, image kept", k);
            k.must(&["delete", "pv", &pv, "--wait=true"]);
            std::fs::remove_file(&img).unwrap();
        }
    }
}

/// Waits until the volume's VolumeAttachment is attached (`true`) or gone (`false`).
fn wait_attached(k: &Kubectl, pv: &str, attached: bool) {
    poll(|| {
        let vas = list(k, "volumeattachment", None);
        let mine: Vec<&Value> = vas
            .iter()
            .filter(|v| v["spec"]["source"]["persistentVolumeName"] == pv)
            .collect();
        match (attached, mine.as_slice()) {
            (true, [v]) if v["status"]["attached"] == true => Ok(()),
            (false, []) => Ok(()),
            _ => Err(format!("{pv}: attachments {mine:?}, want attached={attached}")),
        }
    });
}

fn list(k: &Kubectl, kind: &str, ns: Option<&str>) -> Vec<Value> {
    let mut args = vec!["get", kind, "-o", "json"];
    if let Some(ns) = ns {
        args.extend_from_slice(&["-n", ns]);
    }
    let text = k.must(&args);
    let v: Value = serde_json::from_str(&text).unwrap();
    v["items"].as_array().cloned().unwrap_or_default()
}

/// The claim `c`, every volume, every VolumeAttachment, the node's `volumesAttached` and the
/// reasons of the namespace's Events (which object, which reason; not the reporting component's
/// name, which differs by design), reduced to what the two controller sets must agree on;
/// generated names (UIDs, and so the volumes' `pvc-<uid>`) masked.
fn state(k: &Kubectl, c: &str) -> Vec<String> {
    let mut out = vec![];
    if let Some(x) = list(k, "pvc", Some(NS))
        .iter()
        .find(|x| x["metadata"]["name"] == c)
    {
        let conditions: Vec<String> = x["status"]["conditions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        format!(
                            "{}={}",
                            c["type"].as_str().unwrap_or(""),
                            c["reason"].as_str().unwrap_or("")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(format!(
            "pvc {} phase={} conditions=[{}] {}",
            c,
            x["status"]["phase"].as_str().unwrap_or(""),
            conditions.join(", "),
            meta(x)
        ));
    }
    for pv in list(k, "pv", None) {
        out.push(format!(
            "pv {} phase={} reclaim={} driver={} claimRef={} {}",
            pv["metadata"]["name"].as_str().unwrap_or(""),
            pv["status"]["phase"].as_str().unwrap_or(""),
            pv["spec"]["persistentVolumeReclaimPolicy"].as_str().unwrap_or(""),
            pv["spec"]["csi"]["driver"].as_str().unwrap_or(""),
            pv["spec"]["claimRef"]["name"].as_str().unwrap_or("-"),
            meta(&pv)
        ));
    }
    for va in list(k, "volumeattachment", None) {
        out.push(format!(
            "va attacher={} node={} pv={} attached={} {}",
            va["spec"]["attacher"].as_str().unwrap_or(""),
            va["spec"]["nodeName"].as_str().unwrap_or(""),
            va["spec"]["source"]["persistentVolumeName"]
                .as_str()
                .unwrap_or(""),
            va["status"]["attached"],
            meta(&va)
        ));
    }
    for node in list(k, "node", None) {
        let mut attached: Vec<String> = node["status"]["volumesAttached"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v["name"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        attached.sort();
        out.push(format!(
            "node {} volumesAttached=[{}]",
            node["metadata"]["name"].as_str().unwrap_or(""),
            attached.join(", ")
        ));
    }
    let all_events = list(k, "events", Some(NS));
    // Warnings are printed with their text, for the log: the comparison keeps reasons only.
    for e in all_events.iter().filter(|e| e["type"] == "Warning") {
        println!(
            "warning {}/{} {}: {}",
            e["involvedObject"]["kind"].as_str().unwrap_or(""),
            e["involvedObject"]["name"].as_str().unwrap_or(""),
            e["reason"].as_str().unwrap_or(""),
            e["message"].as_str().unwrap_or("")
        );
    }
    let mut events: Vec<String> = all_events
        .iter()
        .map(|e| {
            format!(
                "event {}/{} {}",
                e["involvedObject"]["kind"].as_str().unwrap_or(""),
                e["involvedObject"]["name"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or("")
            )
        })
        .collect();
    events.sort();
    events.dedup();
    out.extend(events);
    out.into_iter().map(|l| mask_uuids(&l)).collect()
}

/// Every UUID (8-4-4-4-12 hex digits) replaced by `<uid>`.
fn mask_uuids(s: &str) -> String {
    let b = s.as_bytes();
    let is_uuid = |w: &[u8]| {
        w.len() == 36
            && w.iter().enumerate().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => *c == b'-',
                _ => c.is_ascii_hexdigit(),
            })
    };
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if i + 36 <= b.len() && is_uuid(&b[i..i + 36]) {
            out.push_str("<uid>");
            i += 36;
        } else {
            // A UUID is ASCII, so it can only start on a character boundary.
            let c = s[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Annotations (sorted; the kubectl apply record left out: it is the test's, not a controller's)
/// and finalizers (sorted).
fn meta(x: &Value) -> String {
    let mut anns: Vec<String> = x["metadata"]["annotations"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| *k != "kubectl.kubernetes.io/last-applied-configuration")
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    anns.sort();
    let mut fins: Vec<String> = x["metadata"]["finalizers"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str().map(String::from)).collect())
        .unwrap_or_default();
    fins.sort();
    format!(
        "annotations=[{}] finalizers=[{}]",
        anns.join(", "),
        fins.join(", ")
    )
}

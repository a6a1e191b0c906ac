//! The end-to-end suite a user would run: the demo's scenario (docs/examples/) on a real control
//! plane with stowage-controller and two stowage-agents, asserted through real `kubectl` output,
//! then both binaries' /metrics checked against the metrics reference (docs/metrics.md).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use stowage_testkit::binary::Running;
use stowage_testkit::host::{Cleanup, mounts_under};
use stowage_testkit::scrape::Metrics;
use stowage_testkit::{ControlPlane, eventually};

mod support;
use support::{Kubectl, LIMIT, agent_bin};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Metric family names listed in docs/metrics.md under `## <binary>`.
fn documented(binary: &str) -> BTreeSet<String> {
    stowage_testkit::metricsdoc::documented(binary)
        .into_keys()
        .collect()
}

fn families(m: &Metrics) -> BTreeSet<String> {
    m.types.keys().cloned().collect()
}

/// Every family a binary exports is documented; every documented family is exported, except
/// labelled error/failure families that a clean run never touches (a labelled family has no
/// series, and so no exposition, until its first observation; `metrics_doc.rs` checks those
/// against the registry).
fn check_against_docs(binary: &str, m: &Metrics) {
    let docs = documented(binary);
    let seen = families(m);
    let undocumented: Vec<_> = seen
        .iter()
        .filter(|n| !docs.contains(*n) && !n.starts_with("process_"))
        .collect();
    assert!(
        undocumented.is_empty(),
        "{binary} exports undocumented metrics: {undocumented:?}"
    );
    let quiet = [
        "error",
        "fail",
        "forced",
        "conflict",
        "retr",
        "timeout",
        "waiting",
        "cancel",
        "infeasible",
        // KCM's unbound gauges have no series once everything is bound.
        "unbound",
        // Only an agent that serves CSI (the kubelet's node plugin) records its calls; these
        // agents are the kubelet-less kind.
        "csi_sidecar",
    ];
    let missing: Vec<_> = docs
        .iter()
        .filter(|n| !seen.contains(*n) && !n.starts_with("process_") && !quiet.iter().any(|q| n.contains(q)))
        .collect();
    assert!(
        missing.is_empty(),
        "{binary} does not export documented metrics: {missing:?}"
    );
}

fn nonzero(m: &Metrics, name: &str) {
    assert!(m.sum(name) > 0.0, "{name} is zero or missing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_scenario_through_kubectl_and_metrics() {
    let cp = tokio::task::spawn_blocking(ControlPlane::start)
        .await
        .unwrap()
        .unwrap();
    let base = std::env::temp_dir().join(stowage_testkit::unique("stowage-e2e"));
    let images = base.join("images");
    std::fs::create_dir_all(&images).unwrap();
    // The install step: nothing creates, deletes or attaches images without the store's marker.
    let marked = std::process::Command::new(env!("CARGO_BIN_EXE_stowage-controller"))
        .arg("init-image-store")
        .arg(&images)
        .output()
        .unwrap();
    assert!(
        marked.status.success(),
        "{}",
        String::from_utf8_lossy(&marked.stderr)
    );
    assert!(String::from_utf8_lossy(&marked.stdout).contains("marked as the image store"));
    // Dropped last: after the processes below have stopped.
    let _cleanup = Cleanup {
        base: base.clone(),
        images: images.clone(),
    };
    let kc = cp.kubeconfig();
    let ctl = Running::start(
        Path::new(env!("CARGO_BIN_EXE_stowage-controller")),
        &[
            format!("--kubeconfig={}", kc.display()),
            "--leader-elect-resource-namespace=default".into(),
            format!("--image-dir={}", images.display()),
        ],
        &base,
        "controller",
    )
    .unwrap();
    let mut agents = Vec::new();
    for n in ["node-a", "node-b"] {
        agents.push(
            Running::start(
                &agent_bin(),
                &[
                    format!("--kubeconfig={}", kc.display()),
                    format!("--node-name={n}"),
                    format!("--root-dir={}", base.join(n).display()),
                    format!("--image-dir={}", images.display()),
                    "--register-node".into(),
                ],
                &base,
                n,
            )
            .unwrap(),
        );
    }
    let k = Kubectl(kc.clone());
    k.until(
        &["get", "nodes", "-o", "jsonpath={.items[*].metadata.name}"],
        "node-a node-b",
    )
    .await;

    // The administrator's part of the static volumes: their images.
    for (name, size) in [("static-small", 64u64 << 20), ("static-large", 128 << 20)] {
        let f = std::fs::File::create(images.join(format!("{name}.img"))).unwrap();
        f.set_len(size).unwrap();
    }
    k.must(&["apply", "-f", &repo().join("docs/examples").display().to_string()]);

    let claims = [
        "get",
        "pvc",
        "-n",
        "demo",
        "-o",
        "custom-columns=N:.metadata.name,S:.status.phase",
        "--no-headers",
        "--sort-by=.metadata.name",
    ];
    k.until(
        &claims,
        "cache-data   Bound\ndb-data      Bound\nweb-data     Bound",
    )
    .await;
    k.until(
        &[
            "get",
            "pvc",
            "-n",
            "demo",
            "web-data",
            "-o",
            "jsonpath={.spec.volumeName}",
        ],
        "static-small",
    )
    .await;
    k.until(
        &["get", "pv", "static-large", "-o", "jsonpath={.status.phase}"],
        "Available",
    )
    .await;

    // Pods get attached, formatted, mounted volumes on their nodes.
    let vas = [
        "get",
        "volumeattachments",
        "-o",
        "custom-columns=NODE:.spec.nodeName,ATTACHED:.status.attached",
        "--no-headers",
        "--sort-by=.spec.nodeName",
    ];
    k.until(&vas, "node-a   true\nnode-b   true").await;
    for (pod, node) in [("web", "node-a"), ("db", "node-b")] {
        let uid = k.must(&["get", "pod", "-n", "demo", pod, "-o", "jsonpath={.metadata.uid}"]);
        let dir = base.join(node).join("pods").join(uid.trim()).join("volumes");
        eventually(LIMIT, || async {
            if mounts_under(&dir).is_empty() {
                Err(format!("no mount under {}", dir.display()))
            } else {
                Ok(())
            }
        })
        .await;
    }
    let node_status = k.must(&[
        "get",
        "node",
        "node-a",
        "-o",
        "jsonpath={.status.volumesInUse[*]} {.status.volumesAttached[*].name}",
    ]);
    assert!(
        node_status.contains("kubernetes.io/csi/loop.stowage.dev^static-small"),
        "{node_status}"
    );

    // Growing a claim: the controller half, then the node half when a pod mounts it.
    k.must(&[
        "patch",
        "pvc",
        "-n",
        "demo",
        "cache-data",
        "--type=merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ]);
    k.until(
        &[
            "get",
            "pvc",
            "-n",
            "demo",
            "cache-data",
            "-o",
            "jsonpath={.status.allocatedResourceStatuses.storage}",
        ],
        "NodeResizePending",
    )
    .await;
    let pod = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"cache","namespace":"demo"},"spec":{"nodeName":"node-a","containers":[{"name":"c","image":"redis","volumeMounts":[{"name":"d","mountPath":"/data"}]}],"volumes":[{"name":"d","persistentVolumeClaim":{"claimName":"cache-data"}}]}}"#;
    let file = base.join("cache-pod.json");
    std::fs::write(&file, pod).unwrap();
    k.must(&["apply", "-f", &file.display().to_string()]);
    k.until(
        &[
            "get",
            "pvc",
            "-n",
            "demo",
            "cache-data",
            "-o",
            "jsonpath={.status.capacity.storage}",
        ],
        "128Mi",
    )
    .await;

    // Release: Retain keeps the volume (Released) and its image; Delete removes both.
    let db_pv = k.must(&[
        "get",
        "pvc",
        "-n",
        "demo",
        "db-data",
        "-o",
        "jsonpath={.spec.volumeName}",
    ]);
    k.must(&[
        "delete",
        "pod",
        "-n",
        "demo",
        "web",
        "db",
        "--grace-period=0",
        "--force",
    ]);
    k.must(&[
        "delete",
        "pvc",
        "-n",
        "demo",
        "web-data",
        "db-data",
        "--wait=false",
    ]);
    k.until(
        &["get", "pv", "static-small", "-o", "jsonpath={.status.phase}"],
        "Released",
    )
    .await;
    k.until(
        &[
            "get",
            "pv",
            "-o",
            "jsonpath={.items[*].metadata.name}",
            "--sort-by=.metadata.name",
        ],
        &{
            let mut left = [
                k.must(&[
                    "get",
                    "pvc",
                    "-n",
                    "demo",
                    "cache-data",
                    "-o",
                    "jsonpath={.spec.volumeName}",
                ]),
                "static-large".into(),
                "static-small".into(),
            ];
            left.sort();
            left.join(" ")
        },
    )
    .await;
    assert!(images.join("static-small.img").exists(), "Retain keeps the image");
    assert!(
        !images.join(format!("{}.img", db_pv.trim())).exists(),
        "Delete removes the image"
    );
    k.until(
        &[
            "get",
            "volumeattachments",
            "-o",
            "jsonpath={.items[*].spec.nodeName}",
        ],
        "node-a",
    )
    .await;

    // Metrics: parseable, documented, and every controller and agent actually reconciled.
    let cm = ctl.metrics().unwrap();
    assert_eq!(cm.value("stowage_leader"), Some(1.0));
    check_against_docs("stowage-controller", &cm);
    for name in [
        "stowage_binder_reconcile_total",
        "stowage_attachdetach_reconcile_total",
        "stowage_expand_reconcile_total",
        "stowage_protection_reconcile_total",
    ] {
        nonzero(&cm, name);
    }
    // What a kube-controller-manager dashboard reads, under its names: the queues worked, the
    // client counted its requests and its limiter waits, the leader and the bound claims show.
    let series = |name: &str, label: &str| -> f64 {
        let (k, v) = label.split_once('=').expect("label=value");
        cm.samples
            .get(name)
            .into_iter()
            .flatten()
            .filter(|(labels, _)| labels.get(k).map(String::as_str) == Some(v.trim_matches('"')))
            .map(|(_, v)| *v)
            .sum()
    };
    for queue in [
        "claims",
        "volumes",
        "volume_expand",
        "pvcprotection",
        "pvprotection",
    ] {
        let q = format!("name=\"{queue}\"");
        assert!(
            series("workqueue_adds_total", &q) > 0.0,
            "no adds on queue {queue}"
        );
        assert!(
            series("workqueue_work_duration_seconds_count", &q) > 0.0,
            "no finished work on queue {queue}"
        );
    }
    // KCM's volume operation families: the demo provisioned, attached, detached and deleted
    // built-in volumes.
    for op in [
        "volume_provision",
        "volume_attach",
        "volume_detach",
        "volume_delete",
    ] {
        let labels = [
            ("volume_plugin", "kubernetes.io/csi:loop.stowage.dev"),
            ("operation_name", op),
            ("status", "success"),
            ("migrated", "false"),
        ];
        assert!(
            cm.sum_where("storage_operation_duration_seconds_count", &labels) > 0.0,
            "no successful {op} in storage_operation_duration_seconds"
        );
    }
    for op in ["provision", "delete"] {
        let labels = [("plugin_name", "loop.stowage.dev"), ("operation_name", op)];
        assert!(
            cm.sum_where("volume_operation_total_seconds_count", &labels) > 0.0,
            "no end-to-end {op} in volume_operation_total_seconds"
        );
    }
    assert!(
        series("rest_client_requests_total", "code=\"201\"") > 0.0,
        "creates counted"
    );
    assert!(
        series("rest_client_requests_total", "method=\"PUT\"") > 0.0,
        "updates counted"
    );
    nonzero(&cm, "rest_client_request_duration_seconds_count");
    nonzero(&cm, "rest_client_rate_limiter_duration_seconds_count");
    assert_eq!(
        series("leader_election_master_status", "name=\"stowage-controller\""),
        1.0
    );
    nonzero(&cm, "stowage_leader_transitions_total");
    nonzero(&cm, "pv_collector_bound_pvc_count");
    nonzero(&cm, "pv_collector_bound_pv_count");
    for a in &agents {
        let am = a.metrics().unwrap();
        check_against_docs("stowage-agent", &am);
        nonzero(&am, "stowage_agent_operations_total");
        nonzero(&am, "rest_client_requests_total");
    }
    // The controller logged to its stream without colour codes (the log file is its stderr).
    assert!(
        !ctl.log_text().contains('\u{1b}'),
        "escape codes in the controller's log"
    );
}

//! How the scenario acts on the node and looks at it: kubectl against the test control plane
//! (objects, states, logs, and metrics through the apiserver's proxy), the objects it applies,
//! the image archives it imports, and the host's mount table.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use stowage_chart_tests::{Helm, chart_dir, repo_root};
use stowage_testkit::ControlPlane;
use stowage_testkit::host::Cleanup;
use stowage_testkit::realnode::{BUSYBOX_IMAGE, RealNode};
use stowage_testkit::scrape::{self, Metrics};

pub const BOUND: Duration = Duration::from_secs(180);

/// Polls `check` every 500 ms until it passes. `BOUND` only ends a broken test (with the last
/// reason); it is not a speed check: speed is measured by `make bench`.
pub fn poll(mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + BOUND;
    loop {
        match check() {
            Ok(()) => return,
            Err(why) if Instant::now() >= deadline => panic!("{why}"),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}
pub const NS: &str = "app";

pub struct Kubectl {
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    pub fn run(&self, args: &[&str]) -> Result<String, String> {
        stowage_testkit::kubectl::run(&self.kubeconfig, args)
    }

    pub fn must(&self, args: &[&str]) -> String {
        self.run(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The volume a claim of the test namespace is bound to.
    pub fn volume_of(&self, claim: &str) -> String {
        self.must(&["get", "pvc", "-n", NS, claim, "-o", "jsonpath={.spec.volumeName}"])
    }

    pub fn apply(&self, yaml: &str) {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), yaml).unwrap();
        self.must(&["apply", "-f", f.path().to_str().unwrap()]);
    }

    /// Waits until `jsonpath` of the object reads `want`; the state at timeout is in the panic.
    pub fn wait(&self, what: &[&str], jsonpath: &str, want: &str) {
        let start = Instant::now();
        let mut args = vec!["get"];
        args.extend_from_slice(what);
        let jp = format!("jsonpath={jsonpath}");
        args.extend_from_slice(&["-o", &jp]);
        loop {
            let got = self.run(&args).unwrap_or_default();
            if got.trim() == want {
                return;
            }
            if start.elapsed() > BOUND {
                self.show("timeout");
                panic!("{what:?} {jsonpath}: {got:?}, want {want:?}");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    pub fn wait_gone(&self, what: &[&str]) {
        let start = Instant::now();
        let mut args = vec!["get"];
        args.extend_from_slice(what);
        args.push("--ignore-not-found");
        while !self.run(&args).unwrap_or_default().trim().is_empty() {
            if start.elapsed() > BOUND {
                self.show("timeout");
                panic!("{what:?} still there");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The observed state, printed for the CI log.
    pub fn show(&self, step: &str) {
        let state = self
            .run(&["get", "pv,pvc,volumeattachment,pod", "-A", "-o", "wide"])
            .unwrap_or_else(|e| e);
        println!("==> {step}\n{state}");
    }

    pub fn logs(&self, pod: &str) -> String {
        self.run(&["logs", "-n", NS, pod]).unwrap_or_default()
    }

    /// A Prometheus exposition read through the apiserver's proxy, e.g. a kubelet's
    /// `/api/v1/nodes/<node>/proxy/metrics`.
    pub fn metrics(&self, path: &str) -> Result<Metrics, String> {
        scrape::parse(&self.run(&["get", "--raw", path])?)
    }

    /// A field of the test namespace's Events that match `selector` (a field selector such as
    /// `involvedObject.name=x,reason=Y`), e.g. `message`: space-separated.
    pub fn events(&self, selector: &str, field: &str) -> String {
        let jp = format!("jsonpath={{.items[*].{field}}}");
        self.run(&["get", "events", "-n", NS, "--field-selector", selector, "-o", &jp])
            .unwrap_or_default()
    }

    /// The `kind/name` of every object with an Event of `reason`, one a line.
    pub fn event_objects(&self, reason: &str) -> String {
        let selector = format!("reason={reason}");
        self.run(&[
            "get",
            "events",
            "-A",
            "--field-selector",
            &selector,
            "-o",
            "jsonpath={range .items[*]}{.involvedObject.kind}/{.involvedObject.name}{\"\\n\"}{end}",
        ])
        .unwrap_or_default()
    }

    /// Waits until the pod's log holds `want` (what its command printed about its volume).
    pub fn wait_logs(&self, pod: &str, want: &str) {
        poll(|| {
            let logs = self.logs(pod);
            match logs.contains(want) {
                true => Ok(()),
                false => Err(format!("{pod} logs: {logs:?}, want {want:?}")),
            }
        });
    }
}

/// `helm install` of the chart as a user installs it on the real-node cluster, the image store in
/// `mode` (`local`, the chart's default: each node's own store; `shared`: one store every node
/// reads, which the rig's nodes on one machine can also give): the local image, controller and
/// agents on the host network reaching the apiserver at an address every node reaches
/// (`cp.node_host()`), one `agent.kubeletDir` for all nodes, a WaitForFirstConsumer class, the
/// controller's metrics on plain HTTP (the scenarios read them through the apiserver's pod proxy,
/// which passes no credentials on; realnode_prometheus covers the secure default); then the test
/// namespace, and both workloads rolled out (`logs` is printed if one is not).
pub async fn install_mode(
    helm: &Helm,
    k: &Kubectl,
    cp: &ControlPlane,
    images: &Path,
    kubelet_dir: &Path,
    mode: &str,
    logs: impl Fn() -> String,
) {
    let values = helm.values(
        "realnode.yaml",
        &format!(
            r#"image: {{repository: localhost/stowage, tag: "{version}", pullPolicy: Never}}
apiServer: {{host: {host}, port: "{port}"}}
imageStore: {{mode: {mode}, path: {images}}}
controller: {{replicas: 1, hostNetwork: true, securePort: 0}}
agent: {{mode: csi, kubeletDir: {kubelet}, hostNetwork: true}}
storageClass: {{create: true, name: loop, volumeBindingMode: WaitForFirstConsumer, reclaimPolicy: Delete}}
tests: {{image: {{repository: localhost/curl, tag: stowage, pullPolicy: Never}}, hostNetwork: true}}
"#,
            version = env!("CARGO_PKG_VERSION"),
            host = cp.node_host(),
            port = cp.port(),
            images = images.display(),
            kubelet = kubelet_dir.display(),
        ),
    );
    helm.run(&[
        "install",
        "st",
        chart_dir().to_str().unwrap(),
        "-n",
        "stowage",
        "--create-namespace",
        "-f",
        values.to_str().unwrap(),
    ])
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    k.must(&["create", "namespace", NS]);
    for what in ["deployment/st-stowage-controller", "daemonset/st-stowage-agent"] {
        rollout(k, what, &logs);
    }
}

/// Waits for a workload of the chart to roll out; `logs` is printed if it does not.
pub fn rollout(k: &Kubectl, what: &str, logs: impl Fn() -> String) {
    k.run(&["rollout", "status", "-n", "stowage", what, "--timeout=180s"])
        .unwrap_or_else(|e| {
            k.show("rollout failed");
            panic!("{e}\n{}", logs())
        });
}

/// A control plane of its own for a real cluster of `nodes` nodes, and its image store, marked as
/// an install marks it (`stowage-controller init-image-store`): the guard removes the images, and
/// the loop devices over them, before the control plane goes.
pub async fn control_plane(nodes: usize) -> (ControlPlane, PathBuf, Cleanup) {
    let cp = tokio::task::spawn_blocking(move || ControlPlane::start_for_nodes(nodes))
        .await
        .unwrap()
        .unwrap();
    let images = cp.dir().join("images");
    std::fs::create_dir_all(&images).unwrap();
    stowage_loopdriver::ImageStore::new(&images).init().unwrap();
    let cleanup = Cleanup {
        base: images.clone(),
        images: images.clone(),
    };
    (cp, images, cleanup)
}

/// The apiserver's proxy path to the controller pod's metrics: through the pod, not the Service,
/// so they stay readable while the pod's node is NotReady and out of the endpoints. (A pod proxy
/// takes a port number, not a port name.)
pub fn controller_metrics_path(k: &Kubectl) -> String {
    let pod = k.must(&[
        "get",
        "pods",
        "-n",
        "stowage",
        "-l",
        "app.kubernetes.io/component=controller",
        "-o",
        "jsonpath={.items[0].metadata.name}:{.items[0].spec.containers[0].ports[?(@.name==\"metrics\")].containerPort}",
    ]);
    format!("/api/v1/namespaces/stowage/pods/{}/proxy/metrics", pod.trim())
}

/// The id in a store's marker (empty when it has none).
pub fn marker_id(store: &Path) -> String {
    std::fs::read_to_string(store.join(stowage_loopdriver::image::MARKER))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("id: "))
        .unwrap_or_default()
        .to_string()
}

/// A fresh control plane with one real node, and kubectl and helm pointed at it: how every
/// single-node scenario starts. Bind them in this order (`let (cp, images, _cleanup, node, k,
/// helm) = …`): locals drop in reverse, so the node stops before its loop devices are cleaned
/// up, and both before the control plane.
pub async fn single_node() -> (ControlPlane, PathBuf, Cleanup, RealNode, Kubectl, Helm) {
    let archives = archives();
    let (cp, images, cleanup) = control_plane(1).await;
    let node = RealNode::start(&cp, &archives).unwrap_or_else(|e| panic!("real node: {e:#}"));
    node.image_store(&images, false)
        .unwrap_or_else(|e| panic!("image store: {e:#}"));
    let k = Kubectl {
        kubeconfig: cp.kubeconfig(),
    };
    let helm = Helm::new(Some(&cp.kubeconfig()));
    (cp, images, cleanup, node, k, helm)
}

pub fn archives() -> Vec<PathBuf> {
    let dir = repo_root().join("target/image");
    let version = env!("CARGO_PKG_VERSION");
    // The `helm test` checker's image (curl): built on first use, then cached, as helm is.
    let status = Command::new(repo_root().join("e2e/scripts/curl-image.sh"))
        .status()
        .expect("run e2e/scripts/curl-image.sh");
    assert!(status.success(), "e2e/scripts/curl-image.sh failed");
    let list = [
        dir.join(format!("stowage-{version}.oci.tar")),
        dir.join("busybox.oci.tar"),
        dir.join("pause.oci.tar"),
        dir.join("curl.oci.tar"),
    ];
    for a in &list {
        assert!(
            a.exists(),
            "{} is missing: `make test` builds it (e2e/scripts/image.sh, e2e/scripts/pod-images.sh)",
            a.display()
        );
    }
    list.to_vec()
}

/// A pod of `claim` that writes `data-1` to a fresh volume or prints what it found, then its
/// file system's `df` line, and stays.
pub fn pod(name: &str, claim: &str) -> String {
    busybox_pod(
        name,
        claim,
        None,
        r#"if [ -f /data/f ]; then echo "found $(cat /data/f)"; else echo data-1 > /data/f && sync && echo wrote; fi; df -k /data | tail -1"#,
    )
}

pub fn claim(name: &str, class: &str, mode: &str) -> String {
    claim_of(name, class, mode, "64Mi")
}

/// A claim of `size` in the test namespace.
pub fn claim_of(name: &str, class: &str, mode: &str, size: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: {NS}}}
spec:
  accessModes: [{mode}]
  storageClassName: {class}
  resources: {{requests: {{storage: {size}}}}}
"#
    )
}

/// A pod of `claim` that prints what the volume holds (`have: a b `) and its file system's size
/// in KiB (`size: N`), then appends its own name (`wrote <name>`) and stays. `node`: asked of
/// the scheduler (which WaitForFirstConsumer needs), or anywhere.
pub fn writer_pod(name: &str, claim: &str, node: Option<&str>) -> String {
    let script = format!(
        r#"echo "have: $(cat /data/f 2>/dev/null | tr "\n" " ")"; echo "size: $(df -k /data | tail -1 | tr -s " " | cut -d" " -f2)"; echo {name} >> /data/f && sync && echo "wrote {name}""#
    );
    busybox_pod(name, claim, node, &script)
}

/// A busybox pod of the test namespace with `claim` at /data that runs `script` (single-quoted
/// in the manifest: no `'` in it), then sleeps. `node`: asked of the scheduler, or anywhere.
fn busybox_pod(name: &str, claim: &str, node: Option<&str>, script: &str) -> String {
    assert!(!script.contains('\''), "{script}");
    let selector = node
        .map(|n| format!("  nodeSelector: {{kubernetes.io/hostname: {n}}}\n"))
        .unwrap_or_default();
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}}}
spec:
  terminationGracePeriodSeconds: 1
{selector}  containers:
  - name: c
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: [sh, -c, '{script}; sleep 3600']
    volumeMounts: [{{name: v, mountPath: /data}}]
  volumes: [{{name: v, persistentVolumeClaim: {{claimName: {claim}}}}}]
"#
    )
}

/// The built-in driver's class whose volumes outlive their claims.
pub const RETAIN_CLASS: &str = r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: loop-retain}
provisioner: loop.stowage.dev
reclaimPolicy: Retain
volumeBindingMode: WaitForFirstConsumer
"#;

pub fn mounts_of(dir: &Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(dir.to_str().unwrap()) && l.contains(needle))
        .map(String::from)
        .collect()
}

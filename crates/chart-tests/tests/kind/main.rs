//! docs/distributions.md's kind section, run as written on a real kind cluster of this machine:
//! kind v0.33 (e2e/kind), Docker, and a node image built offline (e2e/scripts/kind-node-image.sh:
//! no registry here serves kindest/node). The guide's cluster configuration and its commands are
//! read from the guide; the rig adds only what this machine needs (`DOCKER_HOST` of the rig's
//! dockerd, `--image` of its node image, the test pods' image).
//!
//! On the cluster (one control plane, two workers; KCM's storage controllers off by the guide's
//! patch, which the guide's check reads back):
//! - a claim of the chart's class and a pod writing data on each worker; on the second worker the
//!   free loop devices have no device node (as on a kind node whose container started before the
//!   kernel added them), and the agent makes the one it uses;
//! - the first pod deleted and started again with no node asked: the scheduler follows the
//!   volume's node affinity and the data is there;
//! - the claim grown: recorded at once, the file system grown at the pod's next start (online
//!   ext4 growth needs CAP_SYS_RESOURCE, which root lacks here);
//! - Delete and Retain: the image goes from its node's store, or stays with a Released volume;
//! - the guide's way back: controller off, KCM's controllers on again (they bind a new claim),
//!   the loop pods deleted, `helm uninstall`.
//!
//! Run by `make test-kind` (not `make test`: a cold node image takes minutes to build, and CI's
//! budget is taken by the real-node scenarios). Needs root.

use std::path::PathBuf;
use std::process::Command;

use stowage_chart_tests::repo_root;
use support::{Kubectl, NS, poll};

#[allow(dead_code)]
#[path = "../realnode/support.rs"]
mod support;

const CLUSTER: &str = "stowage";
const DOCKER_HOST: &str = "unix:///run/stowage-rig/docker.sock";

/// A section of docs/distributions.md, by its heading.
fn guide_section(heading: &str) -> String {
    let guide = std::fs::read_to_string(repo_root().join("docs/distributions.md")).unwrap();
    let after = guide
        .split(&format!("\n## {heading}\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("a {heading} section"));
    after.split("\n## ").next().unwrap().to_string()
}

/// The guide's kind section.
fn section() -> String {
    guide_section("kind")
}

/// The first block of `lang` in `text` that holds `needle`, its continuation lines joined.
fn block(text: &str, lang: &str, needle: &str) -> String {
    blocks(text, lang)
        .into_iter()
        .find(|b| b.contains(needle))
        .unwrap_or_else(|| panic!("no {lang} block with {needle:?} in the guide"))
        .replace("\\\n", " ")
}

/// The fenced blocks of `lang` in `text`, in order, without the indentation of a list item.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let open = format!("```{lang}\n");
    text.split(&open)
        .skip(1)
        .map(|b| {
            let body = b.split("```").next().unwrap();
            let indent = body
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.len() - l.trim_start().len())
                .min()
                .unwrap_or(0);
            body.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| format!("{}\n", &l[indent..]))
                .collect()
        })
        .collect()
}

/// The rig: a directory with `kind`, `kubectl` and `helm` on PATH, the kubeconfig kind writes,
/// and the cluster deleted when the test ends, passed or not.
struct Rig {
    dir: tempfile::TempDir,
    cluster: &'static str,
    /// One cluster at a time: each takes most of the machine.
    _one: std::sync::MutexGuard<'static, ()>,
}

static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Rig {
    fn new(cluster: &'static str) -> Self {
        let one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
        let dir = tempfile::Builder::new()
            .prefix("stowage-kind-")
            .tempdir()
            .unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let root = repo_root();
        for (name, target) in [
            ("kind", root.join("e2e/kind/bin/kind")),
            ("kubectl", root.join("e2e/bin/kubectl")),
            ("helm", root.join("e2e/scripts/helm.sh")),
        ] {
            assert!(
                target.exists(),
                "{} is missing: `make test-kind` builds it",
                target.display()
            );
            // A script, not a link: helm.sh finds its module beside itself.
            let exe = bin.join(name);
            std::fs::write(&exe, format!("#!/bin/sh\nexec {} \"$@\"\n", target.display())).unwrap();
            std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        }
        for h in ["config", "cache", "data"] {
            std::fs::create_dir_all(dir.path().join("helm").join(h)).unwrap();
        }
        let rig = Rig {
            dir,
            cluster,
            _one: one,
        };
        // A cluster left by an interrupted run would make `kind create` fail.
        let _ = rig.sh(&format!("kind delete cluster --name {cluster}"));
        rig
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// Runs `line` with bash in the repository's root, as a user at a shell would.
    fn sh(&self, line: &str) -> Result<String, String> {
        let h = self.dir.path().join("helm");
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", line])
            .current_dir(repo_root())
            .env("PATH", path)
            .env("DOCKER_HOST", DOCKER_HOST)
            .env("KUBECONFIG", self.kubeconfig())
            .env("HELM_CONFIG_HOME", h.join("config"))
            .env("HELM_CACHE_HOME", h.join("cache"))
            .env("HELM_DATA_HOME", h.join("data"))
            .output()
            .map_err(|e| format!("{line}: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        match out.status.success() {
            true => Ok(stdout),
            false => Err(format!(
                "{line}: {}\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )),
        }
    }

    fn must(&self, line: &str) -> String {
        println!("$ {line}");
        self.sh(line).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `bash -c script` in one of the cluster's node containers (`docker exec`), as root there.
    fn node(&self, node: &str, script: &str) -> String {
        println!("[{node}]$ {script}");
        let out = Command::new("docker")
            .args(["exec", node, "bash", "-euo", "pipefail", "-c", script])
            .env("DOCKER_HOST", DOCKER_HOST)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "[{node}] {script}: {}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if std::env::var_os("KIND_KEEP").is_none() {
            let _ = self.sh(&format!("kind delete cluster --name {}", self.cluster));
        }
    }
}

/// The guide's commands for the rig: `kind create cluster` is given the node image built here.
fn for_the_rig(line: &str, node_image: &str) -> String {
    match line.starts_with("kind create cluster") {
        true => format!("{line} --image {node_image}"),
        false => line.to_string(),
    }
}

fn claim(name: &str, class: &str, size: &str) -> String {
    support::claim_of(name, class, "ReadWriteOnce", size)
}

/// A pod of `claim` that prints what the volume holds and its size, then appends its own name.
fn pod(name: &str, claim: &str, node: Option<&str>) -> String {
    support::writer_pod(name, claim, node)
}

/// The rig's node image, for this release.
fn node_image(rig: &Rig) -> String {
    let k8s = rig.must("kubectl version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"clientVersion\"][\"gitVersion\"])'");
    format!("stowage.dev/kind-node:{}", k8s.trim())
}

/// The node a PV is pinned to (its required node affinity on the driver's topology key).
fn pinned_node(k: &Kubectl, pv: &str) -> String {
    k.must(&[
        "get",
        "pv",
        pv,
        "-o",
        "jsonpath={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[?(@.key==\"topology.loop.stowage.dev/node\")].values[0]}",
    ])
}

fn delete_pod(k: &Kubectl, name: &str) {
    k.must(&["delete", "pod", "-n", NS, name, "--wait=false"]);
    k.wait_gone(&["pod", "-n", NS, name]);
}

fn file_kib(df_line: &str) -> u64 {
    df_line
        .lines()
        .find_map(|l| l.strip_prefix("size: "))
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn the_kind_guide_runs_as_written() {
    let section = section();
    let rig = Rig::new(CLUSTER);
    let node_image = node_image(&rig);

    // The cluster configuration, saved under the name the guide's commands use.
    let config = block(&section, "yaml", "kind: Cluster");
    assert!(
        section.contains("in a file `kind-stowage.yaml`"),
        "the guide names the file"
    );
    let config_file = repo_root().join("kind-stowage.yaml");
    std::fs::write(&config_file, &config).unwrap();
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _config_file = Remove(config_file);

    // The guide's commands, each line as written.
    // (The block that edits KCM's manifest in the node is the way back, run at the end.)
    let commands: Vec<String> = blocks(&section, "sh")
        .into_iter()
        .filter(|b| !b.contains("docker exec"))
        .collect();
    assert!(!commands.is_empty(), "the guide's kind commands");
    for block in &commands {
        for line in block
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        {
            rig.must(&for_the_rig(line, &node_image));
        }
    }
    let k = Kubectl {
        kubeconfig: rig.kubeconfig(),
    };
    k.show("installed as the guide says");
    // A cluster as a user has it: its DNS answers (the rig relays node DNS to Docker's).
    k.wait(
        &["deployment", "-n", "kube-system", "coredns"],
        "{.status.readyReplicas}",
        "2",
    );

    // The rig's own step: the test pods' image.
    rig.must(&format!(
        "kind load image-archive target/image/busybox.oci.tar --name {CLUSTER}"
    ));

    // The guide's check: every KCM pod runs with the documented value.
    let check = block(
        &guide_section("kubeadm"),
        "sh",
        "component=kube-controller-manager",
    );
    let flags = rig.must(&check);
    let value = config
        .lines()
        .find_map(|l| l.trim().strip_prefix("value: "))
        .unwrap()
        .trim_matches('"')
        .to_string();
    assert_eq!(
        flags.trim(),
        format!("--controllers={value}"),
        "KCM's flag in kind"
    );

    let workers: Vec<String> = k
        .must(&[
            "get",
            "nodes",
            "-l",
            "!node-role.kubernetes.io/control-plane",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(workers.len(), 2, "two workers: {workers:?}");
    k.must(&["create", "namespace", NS]);

    // On the second worker, no free loop device has a node: as a kind node whose container
    // started before the kernel added the devices it will use.
    rig.node(
        &workers[1],
        "for d in /dev/loop[0-9]*; do n=${d#/dev/}; [ -s /sys/block/$n/loop/backing_file ] || rm -f $d; done",
    );

    // A claim and a pod writing data on each worker.
    for (i, w) in workers.iter().enumerate() {
        let c = format!("data{}", i + 1);
        k.apply(&format!(
            "{}---\n{}",
            claim(&c, "loop", "64Mi"),
            pod(&c, &c, Some(w))
        ));
    }
    for (i, w) in workers.iter().enumerate() {
        let c = format!("data{}", i + 1);
        k.wait(&["pod", "-n", NS, &c], "{.status.phase}", "Running");
        k.wait_logs(&c, &format!("wrote {c}"));
        let pv = k.volume_of(&c);
        assert_eq!(
            &pinned_node(&k, &pv),
            w,
            "{c}'s volume is pinned to its pod's node"
        );
        let handle = k.must(&["get", "pv", &pv, "-o", "jsonpath={.spec.csi.volumeHandle}"]);
        rig.node(w, &format!("test -f /var/lib/stowage/images/{handle}.img"));
    }
    let agent_on = |node: &str| {
        k.must(&[
            "get",
            "pods",
            "-n",
            "stowage",
            "-l",
            "app.kubernetes.io/component=agent",
            "--field-selector",
            &format!("spec.nodeName={node}"),
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ])
    };
    let agent2 = agent_on(&workers[1]);
    let log = k.must(&["logs", "-n", "stowage", &agent2, "-c", "agent"]);
    assert!(
        log.contains("made the device node of a new loop device"),
        "the agent on {} made its loop device's node:\n{log}",
        workers[1]
    );

    // The pod moved: deleted and started again with no node asked for; the volume's node
    // affinity brings it back to its node, with its data.
    delete_pod(&k, "data1");
    k.apply(&pod("data1", "data1", None));
    k.wait(&["pod", "-n", NS, "data1"], "{.spec.nodeName}", &workers[0]);
    k.wait_logs("data1", "have: data1");

    // Grown: the claim's new size is recorded at once; the file system grows at the next start.
    let before = file_kib(&k.logs("data1"));
    k.must(&[
        "patch",
        "pvc",
        "-n",
        NS,
        "data1",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ]);
    let pv1 = k.volume_of("data1");
    k.wait(&["pv", &pv1], "{.spec.capacity.storage}", "128Mi");
    delete_pod(&k, "data1");
    k.apply(&pod("data1", "data1", None));
    k.wait(&["pvc", "-n", NS, "data1"], "{.status.capacity.storage}", "128Mi");
    poll(|| {
        let after = file_kib(&k.logs("data1"));
        match after > before + 32 * 1024 {
            true => Ok(()),
            false => Err(format!("file system of data1: {after} KiB, was {before} KiB")),
        }
    });
    k.wait_logs("data1", "have: data1 data1");

    // Delete and Retain.
    k.apply(support::RETAIN_CLASS);
    k.apply(&format!(
        "{}---\n{}",
        claim("kept", "loop-retain", "64Mi"),
        pod("kept", "kept", Some(&workers[1]))
    ));
    k.wait_logs("kept", "wrote kept");
    let pv_kept = k.volume_of("kept");
    let handle_kept = k.must(&["get", "pv", &pv_kept, "-o", "jsonpath={.spec.csi.volumeHandle}"]);
    let handle1 = k.must(&["get", "pv", &pv1, "-o", "jsonpath={.spec.csi.volumeHandle}"]);
    for p in ["data1", "kept"] {
        delete_pod(&k, p);
    }
    k.must(&["delete", "pvc", "-n", NS, "data1", "kept", "--wait=false"]);
    k.wait_gone(&["pv", &pv1]);
    rig.node(
        &workers[0],
        &format!("! test -e /var/lib/stowage/images/{handle1}.img"),
    );
    k.wait(&["pv", &pv_kept], "{.status.phase}", "Released");
    rig.node(
        &workers[1],
        &format!("test -f /var/lib/stowage/images/{handle_kept}.img"),
    );

    move_back(&rig, &k, &value, &workers);
}

/// The guide's "Moving back to kube-controller-manager, and uninstalling", on kind.
fn move_back(rig: &Rig, k: &Kubectl, value: &str, workers: &[String]) {
    assert_eq!(workers.len(), 2);
    // 1. The controller goes; the agent stays.
    rig.must(
        "helm upgrade stowage charts/stowage -n stowage --reuse-values --set controller.enabled=false --wait",
    );
    k.wait_gone(&[
        "pods",
        "-n",
        "stowage",
        "-l",
        "app.kubernetes.io/component=controller",
    ]);
    // 2. KCM's controllers on again, with the guide's command for kind.
    let section = section();
    let back = block(&section, "sh", "docker exec");
    for line in back.lines().filter(|l| !l.trim().is_empty()) {
        rig.must(line);
    }
    let defaults = value.split(",-").next().unwrap().to_string();
    poll(|| {
        let flags = rig
            .sh("kubectl -n kube-system get pods -l component=kube-controller-manager -o jsonpath='{.items[*].spec.containers[0].command}'")
            .unwrap_or_default();
        match flags.contains(&format!("--controllers={defaults}\"")) {
            true => Ok(()),
            false => Err(format!("KCM's flags: {flags}")),
        }
    });
    // KCM binds again: a static volume and its claim.
    k.apply(&format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata: {{name: kcm-binds}}
spec:
  capacity: {{storage: 1Mi}}
  accessModes: [ReadWriteOnce]
  storageClassName: manual
  hostPath: {{path: /tmp/kcm-binds}}
---
{}"#,
        claim("kcm-binds", "manual", "1Mi")
    ));
    k.wait(&["pvc", "-n", NS, "kcm-binds"], "{.status.phase}", "Bound");
    // 3. The loop pods gone, and with them their attachments.
    delete_pod(k, "data2");
    poll(|| {
        let vas = k
            .run(&[
                "get",
                "volumeattachments",
                "-o",
                "jsonpath={.items[*].spec.attacher}",
            ])
            .unwrap_or_default();
        match vas.contains("loop.stowage.dev") {
            false => Ok(()),
            true => Err(format!("attachments left: {vas}")),
        }
    });
    // 4. Uninstall.
    rig.must("helm uninstall stowage -n stowage --wait");
    k.wait_gone(&["pods", "-n", "stowage"]);
    // The Released volume's image is still on its node: an uninstall deletes no data.
    let kept = k.must(&[
        "get",
        "pv",
        "-o",
        "jsonpath={.items[?(@.status.phase==\"Released\")].spec.csi.volumeHandle}",
    ]);
    rig.node(
        &workers[1],
        &format!("test -f /var/lib/stowage/images/{}.img", kept.trim()),
    );
}

/// docs/distributions.md's kubeadm section on a cluster kubeadm made (`kubeadm init` and
/// `kubeadm join` in kind's node containers, no kubeadm patch: kubeadm's own
/// `--controllers=*,bootstrapsigner,tokencleaner`), then a node joined with a new bootstrap
/// token after stowage is installed, which needs the two opt-in controllers the guide keeps.
#[test]
fn the_kubeadm_guide_runs_as_written_and_a_node_joins_after_install() {
    let guide = std::fs::read_to_string(repo_root().join("docs/distributions.md")).unwrap();
    let section = guide_section("kubeadm");
    let rig = Rig::new("kubeadm");
    let node_image = node_image(&rig);
    let config = rig.dir.path().join("cluster.yaml");
    std::fs::write(
        &config,
        "kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnodes:\n- role: control-plane\n- role: worker\n",
    )
    .unwrap();
    rig.must(&format!(
        "kind create cluster --name kubeadm --image {node_image} --config {}",
        config.display()
    ));
    let cp = "kubeadm-control-plane";
    let manifest = "/etc/kubernetes/manifests/kube-controller-manager.yaml";
    let flag = |rig: &Rig| rig.node(cp, &format!("grep -o -- '--controllers=.*' {manifest}"));
    assert_eq!(
        flag(&rig).trim(),
        "--controllers=*,bootstrapsigner,tokencleaner",
        "kubeadm's own"
    );

    // Step 1: the guide's sed, on the control-plane node, as written (sudo included).
    let sed = block(&section, "sh", "sed -i");
    rig.node(cp, sed.trim());
    let value = guide
        .lines()
        .find_map(|l| l.trim().strip_prefix("value: \"*,bootstrapsigner"))
        .map(|v| format!("*,bootstrapsigner{}", v.trim_end_matches('"')))
        .unwrap();
    assert_eq!(flag(&rig).trim(), format!("--controllers={value}"));

    // Step 2: kubeadm-config's ClusterConfiguration, edited as a user would in `kubectl edit`:
    // the guide's entry added to controllerManager's extraArgs (kind's kubeadm config has some).
    let k = Kubectl {
        kubeconfig: rig.kubeconfig(),
    };
    let cc = k.must(&[
        "get",
        "configmap",
        "-n",
        "kube-system",
        "kubeadm-config",
        "-o",
        "jsonpath={.data.ClusterConfiguration}",
    ]);
    let entry: String = block(&section, "yaml", "controllerManager:")
        .lines()
        .skip_while(|l| l.trim() != "extraArgs:")
        .skip(1)
        .map(|l| format!("{l}\n"))
        .collect();
    let edited = match cc.find("controllerManager:\n  extraArgs:\n") {
        Some(at) => {
            let end = at + "controllerManager:\n  extraArgs:\n".len();
            format!("{}{entry}{}", &cc[..end], &cc[end..])
        }
        None => cc.replacen(
            "controllerManager: {}\n",
            &format!("controllerManager:\n  extraArgs:\n{entry}"),
            1,
        ),
    };
    assert_ne!(edited, cc, "the edit found its place:\n{cc}");
    let patch = serde_json::json!({"data": {"ClusterConfiguration": edited}}).to_string();
    k.must(&[
        "patch",
        "configmap",
        "-n",
        "kube-system",
        "kubeadm-config",
        "--type=merge",
        "-p",
        &patch,
    ]);
    // What `kubeadm upgrade` and a new control-plane node do with it: write KCM's manifest from
    // kubeadm-config. Undo step 1 first, so only the configuration can give the value.
    rig.node(cp, &format!("sed -i 's#^    - --controllers=.*#    - --controllers=*,bootstrapsigner,tokencleaner#' {manifest}"));
    rig.node(
        cp,
        "kubectl --kubeconfig /etc/kubernetes/admin.conf get cm -n kube-system kubeadm-config -o jsonpath='{.data.ClusterConfiguration}' > /tmp/cc.yaml && kubeadm init phase control-plane controller-manager --config /tmp/cc.yaml",
    );
    assert_eq!(
        flag(&rig).trim(),
        format!("--controllers={value}"),
        "kubeadm wrote it from kubeadm-config"
    );

    // Step 3: the guide's check, once the kubelet has restarted KCM with it.
    let check = block(&section, "sh", "component=kube-controller-manager");
    poll(|| match rig.sh(check.trim()) {
        Ok(out) if out.trim() == format!("--controllers={value}") => Ok(()),
        other => Err(format!("the guide's check: {other:?}")),
    });

    // Install, as the kind section loads and installs.
    rig.must("kind load image-archive target/image/stowage-*.oci.tar --name kubeadm");
    rig.must("kind load image-archive target/image/busybox.oci.tar --name kubeadm");
    let notes = rig.must("helm install stowage charts/stowage --namespace stowage --create-namespace --set storageClass.create=true --wait");
    // The NOTES give kubeadm's whole flag: the same controllers as the guide (in their order).
    let items = |v: &str| {
        let mut v: Vec<String> = v.split(',').map(String::from).collect();
        v.sort();
        v
    };
    let noted = notes
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("--controllers=*,bootstrapsigner,tokencleaner,")
        })
        .map(|rest| format!("*,bootstrapsigner,tokencleaner,{rest}"))
        .unwrap_or_else(|| panic!("no kubeadm flag in the NOTES:\n{notes}"));
    assert_eq!(items(&noted), items(&value), "the NOTES' kubeadm flag");
    k.must(&["create", "namespace", NS]);

    // A node joins after the install: a new bootstrap token, signed into cluster-info by
    // bootstrapsigner, and `kubeadm join` on a fresh node container (started as kind starts its
    // nodes, on kind's network, labelled so `kind delete cluster` removes it).
    let join = rig.node(cp, "kubeadm token create --print-join-command");
    let token_id = join
        .split_whitespace()
        .skip_while(|w| *w != "--token")
        .nth(1)
        .and_then(|t| t.split('.').next())
        .expect("a token in the join command")
        .to_string();
    poll(|| {
        let signed = k
            .run(&[
                "get",
                "cm",
                "-n",
                "kube-public",
                "cluster-info",
                "-o",
                "jsonpath={.data}",
            ])
            .unwrap_or_default();
        match signed.contains(&format!("jws-kubeconfig-{token_id}")) {
            true => Ok(()),
            false => Err(format!("cluster-info not signed for {token_id}: {signed}")),
        }
    });
    let joiner = "kubeadm-joined";
    rig.must(&format!(
        "docker run -d --name {joiner} --hostname {joiner} --network kind --privileged \
         --security-opt seccomp=unconfined --security-opt apparmor=unconfined --tmpfs /tmp --tmpfs /run \
         --volume /var --volume /lib/modules:/lib/modules:ro --cgroupns=private --init=false \
         --label io.x-k8s.kind.cluster=kubeadm --label io.x-k8s.kind.role=worker {node_image}"
    ));
    poll(
        || match rig.sh(&format!("docker exec {joiner} systemctl is-system-running")) {
            Ok(s) | Err(s) if s.contains("running") || s.contains("degraded") => Ok(()),
            other => Err(format!("{joiner} systemd: {other:?}")),
        },
    );
    // The rig skips kubeadm's preflight as kind does: a node container has swap and cgroup v1.
    rig.node(joiner, &format!("{} --ignore-preflight-errors=all", join.trim()));
    k.wait(
        &["node", joiner],
        "{.status.conditions[?(@.type==\"Ready\")].status}",
        "True",
    );
    rig.must(&format!(
        "kind load image-archive target/image/busybox.oci.tar --name kubeadm --nodes {joiner}"
    ));
    rig.must(&format!(
        "kind load image-archive target/image/stowage-*.oci.tar --name kubeadm --nodes {joiner}"
    ));
    k.wait(
        &["daemonset", "-n", "stowage", "stowage-agent"],
        "{.status.numberReady}",
        "3",
    );
    k.apply(&format!(
        "{}---\n{}",
        claim("joined", "loop", "64Mi"),
        pod("joined", "joined", Some(joiner))
    ));
    k.wait_logs("joined", "wrote joined");
    assert_eq!(pinned_node(&k, &k.volume_of("joined")), joiner);
}

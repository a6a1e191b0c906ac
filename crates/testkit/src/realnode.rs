//! A real cluster on this machine: the test control plane plus kube-controller-manager (its
//! storage controllers off: stowage runs them), kube-scheduler, and per node containerd + runc
//! with a bridge CNI and a kubelet, all built or installed by `make deps controlplane`. Pods are
//! real containers; the kubelet drives CSI drivers through their node plugins.
//!
//! Node 1 (`realnode`) runs in the host's namespaces; a second node (`realnode2`,
//! `RealNode::start_cluster`) in network and mount namespaces of its own (`nodens`), with
//! its own cgroup root.
//!
//! What it takes on these machines (cgroup v1, no CAP_SYS_RESOURCE, `/` a private mount, no
//! registry) is in docs/development.md. Dropping a node stops everything it started (by PID)
//! and removes what they leave: containers, mounts, network namespaces, the bridge, cgroups,
//! sockets outside its directory, and the sysctls the kubelet changed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use base64::Engine;

use crate::ControlPlane;
use crate::controlplane::{binary, log_file};
use crate::process::{free_port, spawn_tied, stop};
pub use nodens::HOST_IP;
use nodens::Isolation;

pub mod external;
mod nodens;
pub mod ssh;

/// The first node's name, and its bearer token (`system:node:realnode` in `system:nodes`, so the
/// Node authorizer admits the kubelet); every test control plane accepts it.
pub const NODE_NAME: &str = "realnode";
pub const NODE_TOKEN: &str = "stowage-node-token";
/// The second node's name (`node_name(1)`).
pub const NODE2_NAME: &str = "realnode2";
/// The most nodes `start_cluster` starts (every test control plane has their tokens).
pub const MAX_NODES: usize = 2;
/// KCM without the controllers stowage replaces.
pub const KCM_CONTROLLERS: &str = "*,-persistentvolume-binder-controller,-persistentvolume-attach-detach-controller,\
-persistentvolume-expander-controller,-persistentvolume-protection-controller,-persistentvolumeclaim-protection-controller";
/// The image of test pods and of the pod sandbox (`e2e/scripts/node-images.sh`).
pub const BUSYBOX_IMAGE: &str = "localhost/busybox:stowage";
pub const PAUSE_IMAGE: &str = "localhost/pause:stowage";
const BRIDGE: &str = "stowbr0";
/// The `kubernetes` Service's cluster IP, which in-cluster clients on the pod network dial
/// (`KUBERNETES_SERVICE_HOST`): the apiserver gives it the first address of its service range,
/// `crate::controlplane::SERVICE_RANGE`.
pub const SERVICE_IP: &str = "10.0.0.1";
/// Every node's kubelet root, as on a real node: node 1's dir is bound here on the host, node 2's
/// here in its mount namespace.
pub const KUBELET_ROOT: &str = "/var/lib/kubelet";
/// Sysctls the kubelet sets; put back on clean-up.
const SYSCTLS: &[&str] = &[
    "vm/overcommit_memory",
    "kernel/panic",
    "kernel/panic_on_oops",
    "net/ipv4/ip_forward",
];

/// The name of node `index` (0-based): `realnode`, `realnode2`, ...
pub fn node_name(index: usize) -> String {
    match index {
        0 => NODE_NAME.to_string(),
        i => format!("{NODE_NAME}{}", i + 1),
    }
}

/// The bearer token of node `index`'s kubelet.
pub fn node_token(index: usize) -> String {
    match index {
        0 => NODE_TOKEN.to_string(),
        _ => format!("{NODE_TOKEN}-{}", node_name(index)),
    }
}

pub struct RealNode {
    pub name: String,
    index: usize,
    dir: PathBuf,
    /// The kubelet's root dir as the kubelet and pods see it: the same path on every node (the
    /// chart's one `agent.kubeletDir`).
    pub kubelet_dir: PathBuf,
    /// Where this node's kubelet files are on the host (`kubelet_dir` on node 1).
    kubelet_backing: PathBuf,
    /// The node's namespaces: a PID one on every node, network and private mount ones from
    /// node 2 on (`nodens`).
    isolation: Isolation,
    kubeconfig: PathBuf,
    containerd_sock: PathBuf,
    kubelet_cmd: Vec<String>,
    /// (name, process), stopped in reverse order.
    children: Mutex<Vec<(String, Child)>>,
    saved_sysctls: Vec<(String, String)>,
    /// Where pods' `kubernetes` Service traffic goes (`service_route`): the apiserver's address
    /// for nodes, on a cluster started for them.
    apiserver_for_pods: Option<String>,
    /// The node's non-loopback address (the kubelet refuses a loopback node IP).
    pub node_ip: String,
}

pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The first global IPv4 address of this machine.
fn node_ip() -> anyhow::Result<String> {
    let out = run(Command::new("ip").args(["-4", "-o", "addr", "show", "scope", "global"]))?;
    out.lines()
        .filter(|l| !l.contains(BRIDGE))
        .find_map(|l| {
            let mut w = l.split_whitespace();
            w.find(|t| *t == "inet")?;
            w.next()?.split('/').next().map(String::from)
        })
        .context("no global IPv4 address: the kubelet needs a non-loopback node IP")
}

impl RealNode {
    /// Starts node 1 (`realnode`, in the host's namespaces) against `cp`, with KCM and the
    /// scheduler, and imports the OCI archives `images` into its containerd.
    pub fn start(cp: &ControlPlane, images: &[PathBuf]) -> anyhow::Result<Self> {
        Self::start_node(cp, images, 0, None, KCM_CONTROLLERS)
    }

    /// `start`, with KCM running `kcm_controllers` (its `--controllers`): `"*"` keeps KCM's own
    /// storage controllers, for a run compared side by side with stowage's.
    pub fn start_with_kcm(
        cp: &ControlPlane,
        images: &[PathBuf],
        kcm_controllers: &str,
    ) -> anyhow::Result<Self> {
        Self::start_node(cp, images, 0, None, kcm_controllers)
    }

    /// Starts `realnode2` beside node 1 (`self`), in namespaces of its own, against `cp`, which
    /// must have been started for two nodes (`ControlPlane::start_for_nodes`). Drop it before
    /// node 1 (node 1 restores the sysctls both kubelets change).
    pub fn start_second(&self, cp: &ControlPlane, images: &[PathBuf]) -> anyhow::Result<Self> {
        Self::start_node(cp, images, 1, Some(&self.kubelet_dir), KCM_CONTROLLERS)
    }

    /// Starts `nodes` nodes (1 or 2), each Ready before this returns; `cp` must have been started
    /// for as many (`ControlPlane::start_for_nodes`).
    pub fn start_cluster(cp: &ControlPlane, images: &[PathBuf], nodes: usize) -> anyhow::Result<Cluster> {
        Self::start_cluster_with_kcm(cp, images, nodes, KCM_CONTROLLERS)
    }

    /// `start_cluster`, with KCM running `kcm_controllers` (see `start_with_kcm`).
    pub fn start_cluster_with_kcm(
        cp: &ControlPlane,
        images: &[PathBuf],
        nodes: usize,
        kcm_controllers: &str,
    ) -> anyhow::Result<Cluster> {
        if !(1..=MAX_NODES).contains(&nodes) {
            bail!("a real cluster has 1 to {MAX_NODES} nodes, not {nodes}");
        }
        let mut cluster = Cluster {
            nodes: vec![Self::start_with_kcm(cp, images, kcm_controllers)?],
        };
        for index in 1..nodes {
            let shared = cluster.nodes[0].kubelet_dir.clone();
            let node = Self::start_node(cp, images, index, Some(&shared), KCM_CONTROLLERS)?;
            cluster.nodes.push(node);
        }
        Ok(cluster)
    }

    /// Node `index`; every node but the first in its own namespaces, its kubelet root bound at
    /// `shared_kubelet_dir` (node 1's).
    fn start_node(
        cp: &ControlPlane,
        images: &[PathBuf],
        index: usize,
        shared_kubelet_dir: Option<&Path>,
        kcm_controllers: &str,
    ) -> anyhow::Result<Self> {
        for tool in ["containerd", "runc", "ctr", "ip", "unshare", "nsenter", "tini"] {
            if which(tool).is_none() {
                bail!("{tool} is not installed: run `make deps`");
            }
        }
        if !Path::new("/usr/lib/cni/bridge").exists() {
            bail!("/usr/lib/cni/bridge is missing: run `make deps`");
        }
        let name = node_name(index);
        if index > 0 && cp.node_host() != HOST_IP {
            bail!(
                "{name}: start the control plane with ControlPlane::start_for_nodes, so the node reaches it"
            );
        }
        let dir = cp.dir().join(&name);
        std::fs::create_dir_all(&dir)?;
        let dir = std::fs::canonicalize(&dir)?;
        // Node 1 puts back the global ones both kubelets change; the rest are per network
        // namespace, and node 2's goes with it.
        let saved_sysctls = match index {
            0 => SYSCTLS
                .iter()
                .filter_map(|s| {
                    let v = std::fs::read_to_string(format!("/proc/sys/{s}")).ok()?;
                    Some((s.to_string(), v.trim().to_string()))
                })
                .collect(),
            _ => vec![],
        };
        let isolation = match index {
            0 => Isolation::host_peer(&dir),
            i => Isolation::own(i, &dir),
        };
        let kubelet_backing = dir.join("kubelet");
        let mut node = Self {
            name,
            index,
            kubelet_dir: shared_kubelet_dir.map_or_else(|| PathBuf::from(KUBELET_ROOT), Path::to_path_buf),
            kubelet_backing,
            kubeconfig: dir.join("kubelet.kubeconfig"),
            containerd_sock: dir.join("containerd/containerd.sock"),
            dir,
            kubelet_cmd: vec![],
            children: Mutex::new(vec![]),
            saved_sysctls,
            apiserver_for_pods: (cp.node_host() != "127.0.0.1")
                .then(|| format!("{}:{}", cp.node_host(), cp.port())),
            node_ip: match isolation.ip() {
                Some(ip) => ip.to_string(),
                None => node_ip()?,
            },
            isolation,
        };
        // From here on, dropping `node` removes whatever a failed step left.
        if index == 0 {
            node.bind_kubelet_root()?;
            node.isolation.create_peer()?;
        } else {
            node.isolation.create(&node.kubelet_dir, &node.kubelet_backing)?;
            make_cgroup_root(&node.name)?;
        }
        node.start_containerd()?;
        for image in images {
            node.import(image)?;
        }
        node.service_route("-A")?;
        if index == 0 {
            node.start_kcm_and_scheduler(cp, kcm_controllers)?;
        }
        node.start_kubelet(cp)?;
        node.wait_ready(cp, Duration::from_secs(120))?;
        Ok(node)
    }

    /// What kube-proxy does for the `kubernetes` Service on a real node, and nothing else: pods on
    /// the pod network reach the apiserver at `SERVICE_IP:443` (in-cluster clients such as the CSI
    /// mock tests' sidecars). A DNAT in the node's network namespace to the address every node
    /// reaches; the bridge's masquerade rule takes care of the replies from node 2. Only on a
    /// cluster started for nodes: a single node's apiserver listens on loopback alone. `op` is
    /// `-A`, or `-D` when node 1 stops (node 2's rule goes with its network namespace).
    fn service_route(&self, op: &str) -> anyhow::Result<()> {
        let Some(to) = &self.apiserver_for_pods else {
            return Ok(());
        };
        let out = self
            .command("iptables")
            .args([
                "-t",
                "nat",
                op,
                "PREROUTING",
                "-d",
                SERVICE_IP,
                "-p",
                "tcp",
                "--dport",
                "443",
            ])
            .args(["-m", "comment", "--comment", "stowage test kubernetes service"])
            .args(["-j", "DNAT", "--to-destination", to])
            .output()
            .context("run iptables")?;
        if op == "-A" && !out.status.success() {
            bail!("iptables: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// `program` in the node's namespaces.
    pub(crate) fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        self.isolation.command(program)
    }

    /// The mount table as the node's kubelet and pods see it.
    pub fn mount_table(&self) -> String {
        self.isolation.mount_table().unwrap_or_default()
    }

    /// Makes `path` the node's image store the way a real host has it: a shared mount (systemd
    /// makes `/` shared; this machine's `/` is private, and containerd refuses the store's
    /// `HostToContainer` propagation on a private mount). With `own`, a node in namespaces of its
    /// own gets a directory of its own there (`<node dir>/images` bound at `path` in its mount
    /// namespace, as a separate machine has its own disk); node 1, whose file systems are the
    /// host's, keeps `path` itself (bound on itself in its mount namespace). Returns where this node's images are, seen from the host. Call it after the
    /// node started and before the agents do.
    pub fn image_store(&self, path: &Path, own: bool) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(path)?;
        let (store, mount) = match self.index > 0 && own {
            true => {
                let backing = self.dir.join("images");
                std::fs::create_dir_all(&backing)?;
                (backing.clone(), backing)
            }
            false => (path.to_path_buf(), path.to_path_buf()),
        };
        let is_mount_point = self
            .mount_table()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .any(|p| Path::new(p) == path);
        if !is_mount_point || mount != path {
            run(self.command("mount").arg("--bind").arg(&mount).arg(path))?;
        }
        run(self.command("mount").arg("--make-rshared").arg(path))?;
        Ok(store)
    }

    /// Node 2's network namespace (`ip netns exec <it>`), `None` on node 1.
    pub fn netns(&self) -> Option<&str> {
        self.isolation.netns()
    }

    /// Runs `cmd` beside the node (a CSI plugin, sidecars, a controller), its output in
    /// `<node dir>/<name>.log`, stopped with the node (before the processes started earlier).
    pub fn spawn_beside(&self, name: &str, cmd: Command) -> anyhow::Result<()> {
        self.spawn(name, cmd)
    }

    fn spawn(&self, name: &str, mut cmd: Command) -> anyhow::Result<()> {
        let log = log_file(&self.dir, &format!("{name}.log"))?;
        cmd.stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let child = spawn_tied(cmd).with_context(|| format!("start {name}"))?;
        self.children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name.to_string(), child));
        Ok(())
    }

    fn start_containerd(&self) -> anyhow::Result<()> {
        let c = self.dir.join("containerd");
        let cni = self.dir.join("cni");
        std::fs::create_dir_all(&c)?;
        std::fs::create_dir_all(&cni)?;
        // Written before containerd starts: a conflist added later was not picked up.
        std::fs::write(
            cni.join("10-stowage.conflist"),
            format!(
                r#"{{"cniVersion":"0.4.0","name":"{network}","plugins":[{{"type":"bridge","bridge":"{bridge}","isGateway":true,"ipMasq":true,"ipam":{{"type":"host-local","ranges":[[{{"subnet":"10.244.{index}.0/24"}}]],"routes":[{{"dst":"0.0.0.0/0"}}]}}}},{{"type":"portmap","capabilities":{{"portMappings":true}}}}]}}"#,
                // Node 1's as they always were; a distinct network name keeps host-local's
                // address records apart.
                network = match self.index {
                    0 => "stowage".to_string(),
                    i => format!("stowage{}", i + 1),
                },
                bridge = self.bridge(),
                index = self.index,
            ),
        )?;
        let d = |p: &str| c.join(p).display().to_string();
        refuse_registries(&c.join("certs.d"))?;
        // restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE, and the sandbox's -998 would
        // fail the start of every pod.
        let config = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{hosts}"
"#,
            root = d("root"),
            state = d("state"),
            sock = self.containerd_sock.display(),
            opt = d("opt"),
            cni = cni.display(),
            hosts = d("certs.d"),
        );
        std::fs::write(c.join("config.toml"), config)?;
        let mut cmd = self.command("containerd");
        cmd.arg("--config").arg(c.join("config.toml"));
        self.spawn("containerd", cmd)?;
        wait_for(Duration::from_secs(30), "containerd socket", || {
            self.containerd_sock.exists()
        })?;
        Ok(())
    }

    /// Imports an OCI archive into containerd's `k8s.io` namespace (the kubelet's).
    pub fn import(&self, archive: &Path) -> anyhow::Result<()> {
        run(Command::new("ctr")
            .arg("-a")
            .arg(&self.containerd_sock)
            .args(["-n", "k8s.io", "images", "import", "--no-unpack"])
            .arg(archive))?;
        Ok(())
    }

    fn start_kcm_and_scheduler(&self, cp: &ControlPlane, controllers: &str) -> anyhow::Result<()> {
        self.start_kcm(cp, controllers)?;
        let kc = cp.kubeconfig().display().to_string();
        let mut sched = Command::new(binary("kube-scheduler")?);
        sched
            .arg(format!("--kubeconfig={kc}"))
            .args(["--leader-elect=false", "--bind-address=127.0.0.1"])
            .arg(format!("--secure-port={}", free_port()))
            .arg(format!(
                "--cert-dir={}",
                self.dir.join("scheduler-certs").display()
            ));
        self.spawn("kube-scheduler", sched)
    }

    /// Stops kube-controller-manager (node 1 runs it) and starts it again with `controllers` as
    /// its `--controllers`, as an edit of its flags restarts it: `"*"` gives it back the storage
    /// controllers stowage ran.
    pub fn restart_kcm(&self, cp: &ControlPlane, controllers: &str) -> anyhow::Result<()> {
        let old = {
            let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
            let i = children
                .iter()
                .position(|(n, _)| n == "kube-controller-manager")
                .context("this node runs no kube-controller-manager")?;
            children.remove(i)
        };
        let (_, mut c) = old;
        self.stop_child(&mut c, Duration::from_secs(20));
        self.start_kcm(cp, controllers)
    }

    fn start_kcm(&self, cp: &ControlPlane, controllers: &str) -> anyhow::Result<()> {
        let kc = cp.kubeconfig().display().to_string();
        let mut kcm = Command::new(binary("kube-controller-manager")?);
        kcm.arg(format!("--kubeconfig={kc}"))
            .arg(format!("--controllers={controllers}"))
            .arg(format!("--root-ca-file={}", cp.dir().join("ca.crt").display()))
            .arg(format!(
                "--service-account-private-key-file={}",
                cp.dir().join("sa.key").display()
            ))
            .args(["--leader-elect=false", "--bind-address=127.0.0.1"])
            .arg(format!("--secure-port={}", free_port()))
            .arg(format!("--cert-dir={}", self.dir.join("kcm-certs").display()));
        self.spawn("kube-controller-manager", kcm)
    }

    /// Node 1's kubelet files live in the node's dir, bound at the standard root (some upstream
    /// e2e tests read /var/lib/kubelet/pods/… on the node). Mount propagation (Bidirectional for
    /// CSI node plugins) needs a shared mount, and `/` is a private one here. Made on the host
    /// before the node's mount namespace copies it, so that copy is a peer: what the kubelet and
    /// pods mount there shows on the host too. Node 2's mount namespace has its own
    /// (`Isolation::create`).
    fn bind_kubelet_root(&self) -> anyhow::Result<()> {
        // What a killed run left bound there.
        for m in crate::host::mounts_under(&self.kubelet_dir) {
            let _ = Command::new("umount").arg("-l").arg(&m).status();
        }
        std::fs::create_dir_all(&self.kubelet_dir)?;
        std::fs::create_dir_all(&self.kubelet_backing)?;
        run(Command::new("mount")
            .arg("--bind")
            .arg(&self.kubelet_backing)
            .arg(&self.kubelet_dir))?;
        run(Command::new("mount").arg("--make-rshared").arg(&self.kubelet_dir))?;
        Ok(())
    }

    fn start_kubelet(&mut self, cp: &ControlPlane) -> anyhow::Result<()> {
        let kd = self.kubelet_dir.display().to_string();
        // Node 1 in the host's network namespace reaches the apiserver on loopback; the others
        // on the host's veth address.
        let (url, token) = match self.index {
            0 => (cp.url(), NODE_TOKEN.to_string()),
            i => (cp.node_url(), node_token(i)),
        };
        let ca = std::fs::read(cp.dir().join("ca.crt"))?;
        let ca_b64 = base64::engine::general_purpose::STANDARD.encode(ca);
        std::fs::write(
            &self.kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {url}\n    certificate-authority-data: {ca_b64}\nusers:\n- name: node\n  user:\n    token: {token}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: node\ncurrent-context: c\n",
            ),
        )?;
        // Disk-based eviction and image GC are off, as kind and minikube turn them off: this
        // node's file systems are the build machine's, which a cold build fills to within a
        // few per cent, and a kubelet under DiskPressure evicts the test's pods (exit 137) and
        // may delete the images it cannot pull again (pullPolicy Never).
        let config = self.dir.join("kubelet.yaml");
        std::fs::write(
            &config,
            format!(
                "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
enforceNodeAllocatable: [pods]
failSwapOn: false
readOnlyPort: 0
port: {port}
healthzPort: 0
healthzBindAddress: 127.0.0.1
containerRuntimeEndpoint: unix://{sock}
podLogsDir: {logs}
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
syncFrequency: 10s
fileCheckFrequency: 10s
evictionHard:
  memory.available: 1Mi
  nodefs.available: \"0%\"
  nodefs.inodesFree: \"0%\"
  imagefs.available: \"0%\"
imageGCHighThresholdPercent: 100
{cgroup_root}",
                // Its own cgroup root keeps node 2's kubepods apart from node 1's.
                cgroup_root = match self.index {
                    0 => String::new(),
                    _ => format!("cgroupRoot: /{}\n", self.name),
                },
                port = free_port(),
                sock = self.containerd_sock.display(),
                logs = self.dir.join("pod-logs").display(),
            ),
        )?;
        self.kubelet_cmd = vec![
            binary("kubelet")?.display().to_string(),
            format!("--config={}", config.display()),
            format!("--kubeconfig={}", self.kubeconfig.display()),
            format!("--root-dir={kd}"),
            format!("--cert-dir={}", self.dir.join("kubelet-pki").display()),
            format!("--hostname-override={}", self.name),
            format!("--node-ip={}", self.node_ip),
            "--v=1".into(),
        ];
        self.spawn_kubelet()
    }

    fn spawn_kubelet(&self) -> anyhow::Result<()> {
        let mut cmd = self.command(&self.kubelet_cmd[0]);
        cmd.args(&self.kubelet_cmd[1..]);
        self.spawn("kubelet", cmd)
    }

    /// Stops the kubelet (its pods keep running, as on a real node); `start_kubelet` brings it back.
    pub fn stop_kubelet(&self) {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = children.iter().position(|(n, _)| n == "kubelet") {
            let (_, mut c) = children.remove(i);
            self.stop_child(&mut c, Duration::from_secs(20));
        }
    }

    /// `stop` for a child of this node. The node's processes run under `nsenter --pid`, which
    /// forks the program into the node's PID namespace and forwards no signal: the program gets
    /// the SIGTERM, and `nsenter` ends with it. (A process started beside the node without it,
    /// such as KCM, has no children to signal.)
    fn stop_child(&self, child: &mut Child, grace: Duration) {
        for pid in nodens::children_of(child.id()) {
            // SAFETY: a plain kill syscall.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        stop(child, grace);
    }

    /// Whether the kubelet this node started is still running.
    pub fn kubelet_running(&self) -> bool {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        children
            .iter_mut()
            .any(|(n, c)| n == "kubelet" && matches!(c.try_wait(), Ok(None)))
    }

    pub fn start_kubelet_again(&self) -> anyhow::Result<()> {
        self.spawn_kubelet()
    }

    /// Stops the kubelet and starts it again.
    pub fn restart_kubelet(&self) -> anyhow::Result<()> {
        self.stop_kubelet();
        self.spawn_kubelet()
    }

    fn wait_ready(&self, cp: &ControlPlane, limit: Duration) -> anyhow::Result<()> {
        let kubectl = binary("kubectl")?;
        wait_for(limit, "node Ready", || {
            Command::new(&kubectl)
                .arg(format!("--kubeconfig={}", cp.kubeconfig().display()))
                .args([
                    "get",
                    "node",
                    &self.name,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                ])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "True")
        })
        .with_context(|| format!("kubelet log tail:\n{}", self.log_tail("kubelet")))
    }

    pub fn log_tail(&self, name: &str) -> String {
        self.log_lines(name, "", 30)
    }

    /// The last `n` lines of a component's log that contain `needle` (all lines when empty).
    pub fn log_lines(&self, name: &str, needle: &str, n: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(needle)).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops everything and removes what the node left on the machine; idempotent.
    pub fn stop(&self) {
        let mut children = std::mem::take(&mut *self.children.lock().unwrap_or_else(|p| p.into_inner()));
        // The kubelet first, so it restarts nothing while containers go.
        if let Some(i) = children.iter().position(|(n, _)| n == "kubelet") {
            let (_, mut c) = children.remove(i);
            self.stop_child(&mut c, Duration::from_secs(20));
        }
        // Containers: every process in a kubepods cgroup (node 1: every node's; node 2: those
        // under its cgroup root), then the shims of our containerd.
        let sock = self.containerd_sock.display().to_string();
        let pods = match self.index {
            0 => "/kubepods".to_string(),
            _ => format!("/{}/", self.name),
        };
        kill_matching(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains(&pods))
        });
        kill_matching(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains("containerd-shim") && c.contains(&sock)
            })
        });
        while let Some((_, mut c)) = children.pop() {
            self.stop_child(&mut c, Duration::from_secs(10));
        }
        // Its mounts, pod network namespaces and (node 2) bridge and hard-coded paths are in its
        // own namespaces; node 1's kubelet mounts are the host's too.
        self.isolation.remove(&[&self.dir, &self.kubelet_dir]);
        if self.index > 0 {
            remove_cgroups(&[&self.name]);
        } else {
            let _ = self.service_route("-D");
            for m in crate::host::mounts_under(&self.kubelet_dir) {
                let _ = Command::new("umount").arg("-l").arg(&m).status();
            }
            for m in crate::host::mounts_under(&self.dir) {
                let _ = Command::new("umount").arg("-l").arg(&m).status();
            }
            // Empty once unbound; left alone if anything else put files there.
            let _ = std::fs::remove_dir(&self.kubelet_dir);
            // The files of the pod network namespaces the CNI plugins made (their mounts were
            // the node's), and the bridge.
            if let Ok(out) = run(Command::new("ip").args(["netns", "list"])) {
                for ns in out.lines().filter_map(|l| l.split_whitespace().next()) {
                    if ns.starts_with("cni-") {
                        let _ = Command::new("ip").args(["netns", "delete", ns]).status();
                    }
                }
            }
            let _ = Command::new("ip")
                .args(["link", "delete", BRIDGE])
                .stderr(Stdio::null())
                .status();
            remove_cgroups(&["kubepods", "k8s.io"]);
            // Paths the kubelet hard-codes outside its own dirs.
            let _ = std::fs::remove_file("/var/lib/kubelet/device-plugins/kubelet.sock");
        }
        for (k, v) in &self.saved_sysctls {
            let _ = std::fs::write(format!("/proc/sys/{k}"), v);
        }
        let _ = std::fs::remove_dir_all(self.dir.join("containerd"));
        let _ = std::fs::remove_dir_all(&self.kubelet_backing);
    }

    fn bridge(&self) -> String {
        match self.index {
            0 => BRIDGE.to_string(),
            i => format!("stowbr{i}"),
        }
    }
}

/// The nodes of a real cluster (`RealNode::start_cluster`); dropping it stops them, the last
/// first.
pub struct Cluster {
    nodes: Vec<RealNode>,
}

impl Cluster {
    pub fn nodes(&self) -> &[RealNode] {
        &self.nodes
    }
}

impl std::ops::Index<usize> for Cluster {
    type Output = RealNode;
    fn index(&self, i: usize) -> &RealNode {
        &self.nodes[i]
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        while let Some(node) = self.nodes.pop() {
            drop(node);
        }
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Every image pull goes to a loopback port that refuses at once: nothing leaves this machine,
/// and an image a test names but no one imported fails its pod in seconds (ErrImagePull naming
/// 127.0.0.1:1) instead of hanging on a registry. `_default` covers any registry; the ones the
/// Kubernetes test images and charts name get their own entry too, so a containerd that reads only
/// named host directories refuses them the same way.
fn refuse_registries(certs_d: &Path) -> anyhow::Result<()> {
    for host in [
        "_default",
        "registry.k8s.io",
        "gcr.io",
        "docker.io",
        "quay.io",
        "ghcr.io",
    ] {
        let dir = certs_d.join(host);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("hosts.toml"),
            "server = \"http://127.0.0.1:1\"\n[host.\"http://127.0.0.1:1\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        )?;
    }
    Ok(())
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

fn wait_for(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{what}: not within {limit:?}")
}

fn kill_matching(matches: impl Fn(i32) -> bool) {
    let own = std::process::id() as i32;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid != own && matches(pid) {
            // SAFETY: a plain kill syscall.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
    std::thread::sleep(Duration::from_millis(300));
}

/// A cgroup `/<name>` in every hierarchy, for a kubelet's `cgroupRoot` (it must exist), with
/// the cpus and memory nodes of the root (a v1 cpuset starts with none).
fn make_cgroup_root(name: &str) -> anyhow::Result<()> {
    // Not the tmpfs that holds the v1 hierarchies.
    for root in cgroup_roots()
        .into_iter()
        .filter(|r| r.join("cgroup.procs").exists())
    {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = std::fs::read_to_string(root.join(f)) {
                std::fs::write(dir.join(f), v.trim()).with_context(|| format!("write {f}"))?;
            }
        }
    }
    Ok(())
}

/// Every v1 hierarchy, and the v2 root.
fn cgroup_roots() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect())
        .unwrap_or_default();
    roots.push(PathBuf::from("/sys/fs/cgroup"));
    roots
}

/// Removes the cgroups `names` (the kubelet's and containerd's: `kubepods`, `k8s.io`; node 2's
/// cgroup root) in every hierarchy, deepest first.
fn remove_cgroups(names: &[&str]) {
    for root in cgroup_roots() {
        for name in names {
            let top = root.join(name);
            if top.is_dir() {
                let mut dirs = vec![];
                collect_dirs(&top, &mut dirs);
                dirs.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
                for d in dirs {
                    let _ = std::fs::remove_dir(&d);
                }
            }
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_dirs(&e.path(), out);
            }
        }
    }
}
